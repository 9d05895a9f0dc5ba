// overmind._C: build a torch.UntypedStorage over a Python buffer without copying.
//
// Note [Storage owns the buffer export]
// The StorageImpl's DataPtr context is a heap Py_buffer taken with
// PyObject_GetBuffer, so the exporter (an mmap of a sealed segment) cannot be
// unmapped while any tensor still points into it. The deleter re-takes the GIL
// and releases the export when the last reference to the storage dies. The
// storage is not resizable: resizing would free memory torch does not own.
#include <torch/extension.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstring>
#include <memory>
#include <string>

namespace py = pybind11;

namespace {

struct BufferDeleter {
  void operator()(Py_buffer* view) const {
    PyBuffer_Release(view);
    delete view;
  }
};

void release_buffer(void* ctx) {
  auto* view = static_cast<Py_buffer*>(ctx);
  if (!Py_IsInitialized()) {
    // Interpreter already finalised: the mapping dies with the process.
    delete view;
    return;
  }
  py::gil_scoped_acquire gil;
  PyBuffer_Release(view);
  delete view;
}

bool is_byte_format(const char* format) {
  return format == nullptr || std::strcmp(format, "B") == 0 ||
      std::strcmp(format, "b") == 0 || std::strcmp(format, "c") == 0;
}

py::object make_untyped_storage(py::handle buffer) {
  if (!PyObject_CheckBuffer(buffer.ptr())) {
    throw py::type_error(
        std::string("_make_untyped_storage: expected an object supporting the "
                    "buffer protocol (mmap, memoryview, bytearray), got ") +
        Py_TYPE(buffer.ptr())->tp_name);
  }
  std::unique_ptr<Py_buffer, BufferDeleter> view(new Py_buffer());
  if (PyObject_GetBuffer(buffer.ptr(), view.get(), PyBUF_FULL_RO) != 0) {
    view.release();  // nothing to release: the export failed
    throw py::error_already_set();
  }
  if (view->readonly) {
    throw py::value_error(
        "_make_untyped_storage: buffer is read-only; torch would crash on the "
        "first in-place write. Map the segment MAP_PRIVATE read/write instead.");
  }
  if (view->ndim > 1) {
    throw py::value_error(
        "_make_untyped_storage: buffer has " + std::to_string(view->ndim) +
        " dimensions; pass a flat 1-D byte buffer (memoryview.cast('B')).");
  }
  if (view->itemsize != 1 || !is_byte_format(view->format)) {
    throw py::value_error(
        std::string("_make_untyped_storage: buffer must hold bytes (format 'B'), got format '") +
        (view->format ? view->format : "?") + "' with itemsize " +
        std::to_string(view->itemsize) + "; cast it with memoryview.cast('B').");
  }
  if (!PyBuffer_IsContiguous(view.get(), 'C')) {
    throw py::value_error(
        "_make_untyped_storage: buffer is not contiguous (stride " +
        std::to_string(view->strides ? view->strides[0] : 0) +
        "); slice with step 1 only.");
  }
  const auto nbytes = static_cast<size_t>(view->len);
  void* data = view->buf;
  Py_buffer* ctx = view.release();  // now owned by the DataPtr
  c10::Storage storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(),
      nbytes,
      at::DataPtr(data, ctx, &release_buffer, at::Device(at::DeviceType::CPU)),
      /*allocator=*/nullptr,
      /*resizable=*/false));
  return py::reinterpret_steal<py::object>(THPStorage_Wrap(std::move(storage)));
}

// Build every plain tensor of a skeleton in one call (Note [Tensors as table entries]
// in reductions.py). records: (storage index, torch.dtype, offset, size, stride,
// requires_grad, parameter). set_ checks that each view fits its storage.
py::list build_tensors(py::list storages, py::list records, py::handle parameter_type) {
  std::vector<c10::Storage> unpacked;
  unpacked.reserve(storages.size());
  for (auto item : storages) {
    if (!THPStorage_Check(item.ptr())) {
      throw py::type_error("_build_tensors: storages must be torch.UntypedStorage objects");
    }
    unpacked.push_back(THPStorage_Unpack(item.ptr()));
  }
  py::object make_subclass = py::module_::import("torch").attr("Tensor").attr("_make_subclass");
  py::list out(records.size());
  size_t i = 0;
  for (auto item : records) {
    auto rec = py::reinterpret_borrow<py::tuple>(item);
    if (rec.size() != 7) {
      throw py::value_error("_build_tensors: record " + std::to_string(i) + " has " +
                            std::to_string(rec.size()) + " fields, expected 7");
    }
    auto index = rec[0].cast<int64_t>();
    if (index < 0 || static_cast<size_t>(index) >= unpacked.size()) {
      throw py::value_error("_build_tensors: record " + std::to_string(i) + " names storage " +
                            std::to_string(index) + " of " + std::to_string(unpacked.size()));
    }
    if (!THPDtype_Check(rec[1].ptr())) {
      throw py::type_error("_build_tensors: record " + std::to_string(i) + " has no torch.dtype");
    }
    auto dtype = reinterpret_cast<THPDtype*>(rec[1].ptr())->scalar_type;
    auto offset = rec[2].cast<int64_t>();
    auto size = rec[3].cast<std::vector<int64_t>>();
    auto stride = rec[4].cast<std::vector<int64_t>>();
    if (size.size() != stride.size()) {
      throw py::value_error("_build_tensors: record " + std::to_string(i) + " has " +
                            std::to_string(size.size()) + " sizes but " +
                            std::to_string(stride.size()) + " strides");
    }
    const c10::Storage& storage = unpacked[index];
    at::Tensor tensor = at::empty({0}, at::TensorOptions().dtype(dtype).device(storage.device()));
    tensor.set_(storage, offset, size, stride);
    bool requires_grad = rec[5].cast<bool>();
    py::object wrapped = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(tensor)));
    if (rec[6].cast<bool>()) {
      wrapped = make_subclass(parameter_type, wrapped, requires_grad);
    } else if (requires_grad) {
      wrapped.attr("requires_grad_")(true);
    }
    out[i++] = std::move(wrapped);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "overmind native helpers: zero-copy storages over shared memory";
  m.def("_make_untyped_storage", &make_untyped_storage, py::arg("buffer"),
        "Return a torch.UntypedStorage sharing `buffer`'s memory (no copy).");
  m.def("_build_tensors", &build_tensors, py::arg("storages"), py::arg("records"),
        py::arg("parameter_type"), "Build skeleton tensors over their storages in one call.");
}
