"""overmind.shared.segments.reductions: pickling through sealed segments, zero-copy and isolated."""

from __future__ import annotations

import gc
import os
import pickle

import pytest
import torch

from overmind.shared.segments.reductions import pack, unpack

from ..conftest import run_python
from ..helpers.mappings import inside, mapping_ranges


def rebuild(packed):
    mappings = packed.map_private()
    return unpack(packed.skeleton, mappings), mappings


def open_in_child(packed) -> str:
    """Python expression, for a child process, that maps ``packed``'s segments through /proc."""
    return (f"[None if h is None else Segment.open_proc({os.getpid()}, h[0], h[1]).map_private() "
            f"for h in {packed.handles()!r}]")


ALL_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_round_trips_bit_exactly(dtype):
    src = (torch.randn(7, 5) * 4).to(dtype) if dtype != torch.bool else torch.rand(7, 5) > 0.5
    packed = pack({"t": src})
    again, _ = rebuild(packed)
    assert again["t"].dtype == dtype
    assert torch.equal(again["t"].view(torch.uint8), src.view(torch.uint8))


def test_views_offsets_strides_and_shared_storage_survive():
    base = torch.arange(100, dtype=torch.float32)
    obj = {
        "base": base,
        "slice": base[10:30],
        "strided": base.view(10, 10).t(),
        "narrow": base.view(10, 10)[2:5, 3:9],
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(3.5),
    }
    packed = pack(obj)
    assert packed.storages == 3  # base storage once, plus the empty and the scalar
    again, _ = rebuild(packed)
    for key, value in obj.items():
        assert torch.equal(again[key], value), key
        assert again[key].stride() == value.stride() and again[key].storage_offset() == value.storage_offset()
    assert again["slice"].untyped_storage().data_ptr() == again["base"].untyped_storage().data_ptr()
    again["base"][15] = -1
    assert again["slice"][5] == -1  # still one storage after the round trip


def test_parameters_keep_type_and_requires_grad():
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    trained = torch.nn.Parameter(torch.ones(3))
    grad_tensor = torch.ones(2).requires_grad_()
    again, _ = rebuild(pack([frozen, trained, grad_tensor]))
    assert type(again[0]) is torch.nn.Parameter and not again[0].requires_grad
    assert type(again[1]) is torch.nn.Parameter and again[1].requires_grad
    assert type(again[2]) is torch.Tensor and again[2].requires_grad


def test_tied_weights_stay_tied():
    from overmind.modelgen import build_lm

    model = build_lm("tiny")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    again, _ = rebuild(pack(model))
    assert again.lm_head.weight is again.model.embed_tokens.weight


def test_objects_handed_back_stay_references_whatever_their_type():
    # Note [Objects persistent_id passes over]: a state dict (torch.load's result) or a module
    # handed back to a later load is the caller's own object in the rebuilt result, not a copy.
    from overmind.modelgen import build_lm

    state = {"w": torch.arange(4.0)}
    layers = [torch.nn.Linear(2, 2)]
    model = build_lm("tiny")
    result = {"state": state, "layers": layers, "model": model, "name": "x", "sizes": (1, 2)}
    packed = pack(result, references={id(state): "a", id(layers): "b", id(model): "c"})
    again = unpack(packed.skeleton, packed.map_private(), references={"a": state, "b": layers, "c": model})
    assert again["state"] is state and again["layers"] is layers and again["model"] is model
    assert again["name"] == "x" and again["sizes"] == (1, 2)
    assert packed.nbytes < sum(p.nbytes for p in model.parameters())  # nothing of theirs was packed


def test_untyped_and_typed_storages_and_subclass_tensors_round_trip():
    class Tagged(torch.Tensor):
        pass

    storage = torch.arange(8, dtype=torch.int16).untyped_storage()
    sub = torch.arange(4.0).as_subclass(Tagged)
    hooked = torch.arange(3.0)
    hooked.note = "extra state"  # a __dict__ sends the tensor through torch's own reduction
    again, mappings = rebuild(pack({"storage": storage, "typed": torch.arange(3.0).storage(), "hooked": hooked}))
    assert bytes(again["storage"]) == bytes(storage)
    assert again["typed"].dtype == torch.float32 and list(again["typed"]) == [0.0, 1.0, 2.0]
    assert again["hooked"].note == "extra state" and torch.equal(again["hooked"], hooked)
    assert inside(mapping_ranges(mappings), again["hooked"])
    del sub


def test_objects_stdlib_pickle_cannot_handle_fall_back_to_dill():
    scale = 3

    obj = {"fn": lambda x: x * scale, "w": torch.ones(4)}
    packed = pack(obj)
    assert packed.pickler == "dill"
    again, _ = rebuild(packed)
    assert again["fn"](2) == 6 and torch.equal(again["w"], obj["w"])


def test_every_rebuilt_storage_lies_inside_the_mapping():
    from overmind.modelgen import build_unet

    again, mappings = rebuild(pack(build_unet("tiny")))
    ranges = mapping_ranges(mappings)
    tensors = [t for t in again.state_dict().values() if t.numel()]
    assert tensors and all(inside(ranges, t) for t in tensors)


def test_storages_are_spread_over_one_segment_per_fill_thread():
    packed = pack([torch.ones(1 << 20) for _ in range(6)], writers=2)
    assert len(packed.segments) == 2 and all(seg is not None and seg.sealed for seg in packed.segments)
    again, _ = rebuild(packed)
    assert all(torch.equal(t, torch.ones(1 << 20)) for t in again)


def test_rebuilding_a_1gb_model_does_not_copy_its_bytes():
    """Zero copy, proven on RSS: 1 GiB of weights rebuilt raise RSS by < 5% before first use."""
    layers = [torch.nn.Linear(4096, 4096, bias=False, dtype=torch.float16) for _ in range(32)]  # 1 GiB
    model = torch.nn.Sequential(*layers)
    with torch.no_grad():
        for layer in layers:
            layer.weight.fill_(0.5)
    nbytes = sum(p.nbytes for p in model.parameters())
    assert nbytes >= 1 << 30
    packed = pack(model)
    del model, layers
    gc.collect()
    out = run_python(f"""
        import json, psutil, torch, ctypes
        from overmind.shared.segments.memfd import Segment
        from overmind.shared.segments.reductions import unpack
        skeleton = open({_dump_skeleton(packed)!r}, "rb").read()
        rss0 = psutil.Process().memory_info().rss
        mappings = {open_in_child(packed)}
        model = unpack(skeleton, mappings)
        rss1 = psutil.Process().memory_info().rss
        ranges = [(ctypes.addressof(ctypes.c_char.from_buffer(m)), len(m)) for m in mappings if m is not None]
        inside = all(any(b <= p.data_ptr() < b + n for b, n in ranges) for p in model.parameters())
        first = float(model[0].weight[0, 0])
        print(json.dumps([rss1 - rss0, inside, first]))
    """).stdout
    import json

    rss_delta, inside, first = json.loads(out.strip().splitlines()[-1])
    packed.close()
    assert inside and first == 0.5
    assert rss_delta < 0.05 * nbytes, f"RSS grew by {rss_delta} bytes for {nbytes} bytes of weights"


_skeleton_files: list[str] = []


def _dump_skeleton(packed) -> str:
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".skeleton")
    os.write(fd, packed.skeleton)
    os.close(fd)
    _skeleton_files.append(path)
    return path


@pytest.fixture(scope="module", autouse=True)
def _cleanup_skeletons():
    yield
    for path in _skeleton_files:
        os.unlink(path)


def test_in_place_edits_are_invisible_to_other_rebuilds_and_processes():
    from overmind.modelgen import build_unet

    model = build_unet("tiny")
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    packed = pack(model)
    edited, _ = rebuild(packed)
    with torch.no_grad():
        edited.conv_in.weight.data.mul_(0)
        edited.load_state_dict({k: torch.full_like(v, 7) for k, v in edited.state_dict().items()})
    edited.fuse_qkv_projections()
    second, _ = rebuild(packed)
    for key, value in second.state_dict().items():
        assert torch.equal(value, reference[key]), key
    # ...and in another process, the segment still holds the original bytes.
    expected = sum(float(v.double().sum()) for v in reference.values())
    out = run_python(f"""
        from overmind.shared.segments.memfd import Segment
        from overmind.shared.segments.reductions import unpack
        skeleton = open({_dump_skeleton(packed)!r}, "rb").read()
        model = unpack(skeleton, {open_in_child(packed)})
        print(repr(sum(float(v.double().sum()) for v in model.state_dict().values())))
    """).stdout
    assert float(out.strip().splitlines()[-1]) == expected


def test_real_models_give_bit_identical_outputs_in_a_fresh_process():
    """A diffusers UNet and VAE and a transformers causal LM, rebuilt in another process."""
    from overmind.modelgen import build_lm, build_unet, build_vae

    torch.manual_seed(0)
    models = {"unet": build_unet("tiny", seed=1), "vae": build_vae("tiny", seed=2), "lm": build_lm("tiny", seed=3)}
    inputs = {
        "unet": (torch.randn(1, 4, 16, 16), torch.tensor([10]), torch.randn(1, 3, 32)),
        "vae": torch.randn(1, 3, 32, 32),
        "lm": torch.randint(0, 512, (1, 12)),
    }
    with torch.no_grad():
        expected = {
            "unet": models["unet"](*inputs["unet"]).sample,
            "vae": models["vae"](inputs["vae"]).sample,
            "lm": models["lm"](inputs["lm"]).logits,
        }
    packed = pack(models)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        torch.save({"inputs": inputs, "expected": expected}, f"{tmp}/io.pt")
        out = run_python(f"""
            import torch
            from overmind.shared.segments.memfd import Segment
            from overmind.shared.segments.reductions import unpack
            skeleton = open({_dump_skeleton(packed)!r}, "rb").read()
            models = unpack(skeleton, {open_in_child(packed)})
            data = torch.load("{tmp}/io.pt")
            inputs, expected = data["inputs"], data["expected"]
            with torch.no_grad():
                got = {{
                    "unet": models["unet"](*inputs["unet"]).sample,
                    "vae": models["vae"](inputs["vae"]).sample,
                    "lm": models["lm"](inputs["lm"]).logits,
                }}
            for k in expected:
                assert torch.equal(got[k], expected[k]), k
            print(type(models["unet"]).__name__, type(models["vae"]).__name__, type(models["lm"]).__name__)
        """).stdout
    assert out.split() == ["UNet2DConditionModel", "AutoencoderKL", "LlamaForCausalLM"]


@pytest.mark.parametrize(
    "skeleton",
    [b"", b"garbage", pickle.dumps(("overmind-skeleton-0", [], [], b"")), pickle.dumps(42)],
    ids=["empty", "garbage", "old-format", "not-a-tuple"],
)
def test_bad_skeletons_raise_a_clear_error(skeleton):
    with pytest.raises((pickle.UnpicklingError, EOFError)):
        unpack(skeleton, [])


def test_storage_outside_its_segment_is_refused():
    packed = pack({"w": torch.ones(1024)}, writers=1)
    mapping = packed.segments[0].map_private()
    fmt, storages, objects, payload = pickle.loads(packed.skeleton)
    bad = pickle.dumps((fmt, [(0, 0, 10 * len(mapping), "cpu")], objects, payload))
    with pytest.raises(pickle.UnpicklingError, match="outside"):
        unpack(bad, [mapping])
    with pytest.raises(pickle.UnpicklingError, match="segment"):
        unpack(packed.skeleton, [])


def test_unpack_refuses_a_non_bytes_skeleton():
    with pytest.raises(TypeError):
        unpack(12, [])


def test_meta_tensors_cannot_be_cached():
    with pytest.raises(pickle.PicklingError, match="meta"):
        pack({"t": torch.empty(3, device="meta").untyped_storage()})


class PackedContents:
    """A ContentStore over the segments of earlier packs (what overmind.warm.dedup gets from the server)."""

    def __init__(self, *packs) -> None:
        self.segments = [seg for p in packs for seg in p.segments]
        self.regions: dict = {}
        base = 0
        for p in packs:
            for digest, nbytes, segment, offset in p.contents:
                self.regions.setdefault((bytes.fromhex(digest), nbytes), []).append((base + segment, offset))
            base += len(p.segments)
        self.used: set = set()

    def find(self, digest, nbytes):
        for region in self.regions.get((digest, nbytes), ()):
            if region not in self.used:
                self.used.add(region)
                return region
        return None


def test_contents_a_store_holds_are_referenced_not_copied_and_stay_distinct():
    from overmind.shared.segments.reductions import DEDUP_MIN_BYTES

    big = torch.randn(DEDUP_MIN_BYTES // 4)
    model = {"a": big, "twin": big.clone(), "other": torch.randn(DEDUP_MIN_BYTES // 4), "small": torch.ones(8)}
    first = pack(model)
    assert first.contents == [] and first.deduplicated == 0  # no store: nothing hashed
    first = pack(model, store=PackedContents())
    assert len(first.contents) == 3 and first.deduplicated == 0

    copy = {k: v.clone() for k, v in model.items()}
    store = PackedContents(first)
    second = pack(copy, store=store)
    assert second.deduplicated == 3 * big.nbytes and second.nbytes < 1024
    # Equal contents in one pack still get one region each: a write to one must not reach the other.
    assert len({(s, o) for _, _, s, o in second.contents}) == 3
    mappings = second.map_private() + [seg.map_private() for seg in store.segments]
    again = unpack(second.skeleton, mappings)
    assert all(torch.equal(again[k], model[k]) for k in model)
    ranges = mapping_ranges(mappings[len(second.segments):])
    assert all(inside(ranges, again[k]) for k in ("a", "twin", "other"))
    again["a"].mul_(0)
    assert torch.equal(again["twin"], big) and not torch.equal(again["a"], big)
    assert torch.equal(unpack(first.skeleton, first.map_private())["a"], big)


def storage_table(packed) -> list:
    from overmind.shared.segments.reductions import StorageRef

    return [StorageRef(*s) for s in pickle.loads(packed.skeleton)[1]]


MiB = 1 << 20
# Pickling order: small, large, small, large, ... (Note [Large storages on huge pages]).
LAYOUT_SIZES = [2 * MiB - 100_000, 3 * MiB, 60_000, 40 * MiB, 300_000, 3 * MiB, 5 * MiB // 2, 64]


def test_large_storages_start_on_huge_page_offsets_where_cheap_and_small_ones_fill_the_gaps_before_them():
    from overmind.shared.segments.memfd import HUGE_PAGE

    tensors = [torch.full((n,), i + 1, dtype=torch.uint8) for i, n in enumerate(LAYOUT_SIZES)]
    packed = pack(tensors, writers=1)
    table = storage_table(packed)
    starts = [ref.offset - ref.offset % 64 for ref in table]
    for ref, tensor in zip(table, tensors):
        assert ref.offset % 64 == tensor.data_ptr() % 64  # Note [Same alignment, same numbers]
    # 3 MiB after 1.9 MiB: 100 kB of padding (< 1/16) puts it on 2 MiB; so for 40 MiB after 1 MiB of
    # padding and 3 MiB right on a boundary; 2.5 MiB would skip 1 MiB (> 1/16): a page, as before.
    assert [start % HUGE_PAGE == 0 for start in starts] == [True, True, False, True, False, True, False, False]
    assert starts[6] % 4096 == 0
    # The small ones after the first large one went into the gaps before 3 MiB and 40 MiB.
    assert starts[2] < starts[1] and starts[4] < starts[3] and starts[7] < starts[1]
    seg = packed.segments[0]
    end = starts[6] + LAYOUT_SIZES[6]
    assert end == 51 * MiB + MiB // 2  # nothing but the one page-aligned storage after the last large one
    assert seg.size == (52 * MiB if seg.huge else end)
    again, _ = rebuild(packed)
    assert all(torch.equal(a, b) for a, b in zip(again, tensors))


def test_a_model_packed_where_huge_pages_are_possible_round_trips_in_whole_huge_pages(monkeypatch):
    """Note [Huge pages for segments]: where the setting allows huge pages, segments are sealed
    at whole 2 MiB and collapsed; forced here so that the path runs whatever this machine's setting."""
    from overmind.shared.segments import memfd
    from overmind.shared.segments.memfd import HUGE_PAGE, SEAL_ALL

    monkeypatch.setattr(memfd, "huge_pages_possible", lambda: True)
    tensors = [torch.randn(n // 4) for n in (4096, 40 * MiB, 8 * MiB + 4, 1000 * 4, 30 * MiB)]
    packed = pack(tensors, writers=2)
    for seg in packed.segments:
        assert seg.huge and seg.seals() & SEAL_ALL == SEAL_ALL
        seg.collapse_to_huge_pages()  # refused under never; either way the bytes stay
        assert seg.size % HUGE_PAGE == 0 and os.fstat(seg.fd).st_size == seg.size
    again, mappings = rebuild(packed)
    assert all(torch.equal(a, b) for a, b in zip(again, tensors))
    again[1].mul_(2)  # copy-on-write: a second rebuild sees the original
    other, _ = rebuild(packed)
    assert torch.equal(other[1], tensors[1]) and not torch.equal(again[1], tensors[1])


class InAFile:
    """A ContentStore that finds given storages in a sealed segment standing for their model file
    (overmind.warm.dedup.SegmentContents finds them in the file's own pages), and whose index holds
    regions of the sizes ``indexed``."""

    def __init__(self, tensors: list, indexed: set) -> None:
        from overmind.shared.segments.memfd import Segment

        self.offsets, end = {}, 0
        for t in tensors:
            self.offsets[t.untyped_storage().data_ptr()] = end
            end += 1 << 20
        self.segment = Segment.create("file", end)
        for t in tensors:
            storage = t.untyped_storage()
            self.segment.write_at(self.offsets[storage.data_ptr()], bytes(memoryview(t.numpy()).cast("B")))
        self.segment.seal()
        self.indexed = indexed

    def find(self, digest, nbytes):
        return None

    def may_hold(self, address, nbytes):
        return nbytes in self.indexed

    def in_file(self, address, nbytes):
        offset = self.offsets.get(address)
        return None if offset is None else (0, offset)


def test_a_storage_left_in_its_file_is_hashed_after_the_pack_only_where_nothing_indexed_has_its_size():
    from overmind.shared.segments.reductions import DEDUP_MIN_BYTES, hash_regions

    first, second = torch.randn(DEDUP_MIN_BYTES // 4), torch.randn(DEDUP_MIN_BYTES // 2)
    model = {"first": first, "second": second, "small": torch.ones(8)}
    store = InAFile([first, second], indexed=set())
    now = pack(model, store=store)  # as before: every storage hashed while packing
    assert now.unhashed == [] and len(now.contents) == 2

    later = pack(model, store=store, hash_files_later=True)
    assert later.contents == [] and len(later.unhashed) == 2 and later.nbytes < 1024
    assert sorted(hash_regions(later.unhashed)) == sorted(now.contents)  # the records the pack would have made
    again = unpack(later.skeleton, later.map_private() + [store.segment.map_private()])
    assert all(torch.equal(again[k], model[k]) for k in model)

    # A region of `second`'s size is indexed: it could be found, so it is hashed while packing.
    partly = pack(model, store=InAFile([first, second], indexed={second.nbytes}), hash_files_later=True)
    assert [r[1] for r in partly.contents] == [second.nbytes]
    assert [u[1] for u in partly.unhashed] == [first.nbytes]
    store.segment.close()


def test_a_region_of_the_same_size_is_probed_and_only_a_matching_probe_costs_a_whole_hash():
    """Note [Probing before hashing] in overmind.warm.dedup: the real store over a real sealed
    segment, opened through /proc/<pid>/fd with its identity checked, as a loader opens the server's."""
    import xxhash

    from overmind.shared.segments.memfd import Segment
    from overmind.shared.segments.reductions import DEDUP_MIN_BYTES
    from overmind.warm import dedup

    held = torch.randn(DEDUP_MIN_BYTES)  # 256 KiB, over PROBE
    raw = bytes(memoryview(held.numpy()).cast("B"))
    segment = Segment.create("held", len(raw))
    segment.write_at(0, raw)
    segment.seal()
    st = os.fstat(segment.fd)
    index = {"keys": ["k" * 64], "handles": [[[segment.fd, len(raw), st.st_dev, st.st_ino]]],
             "regions": [[xxhash.xxh3_128_hexdigest(raw), len(raw), 0, st.st_dev, st.st_ino, 0]]}
    store = dedup.SegmentContents(index, os.getpid())
    try:
        same, other = held.clone(), torch.randn(DEDUP_MIN_BYTES)
        tail_differs = held.clone()
        tail_differs[-1] += 1  # same probe, other bytes: hashed whole, and not found
        address = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
        assert store.may_hold(address(same), len(raw))
        assert store.may_hold(address(tail_differs), len(raw))
        assert not store.may_hold(address(other), len(raw))  # same size, other bytes: no hash needed
        assert not store.may_hold(address(held[:-1]), len(raw) - 4)  # no region of that size
        assert store.fds == [] and store.holders == []  # probing named no segment of this pack's
        # What the probe let through is decided by the whole hash, as before.
        digest = lambda t: xxhash.xxh3_128_digest(bytes(memoryview(t.numpy()).cast("B")))  # noqa: E731
        assert store.find(digest(tail_differs), len(raw)) is None
        assert store.find(digest(same), len(raw)) == (0, 0)
        assert len(store.fds) == 1 and store.holders == ["k" * 64]
    finally:
        store.close()
        segment.close()


def test_a_segment_that_cannot_be_mapped_is_copied_around_and_leaves_no_fd_open():
    """A segment the loader opens but cannot map (here: empty, so there is nothing to map; in
    life, an address-space limit) is treated as evicted: the bytes are stored, and the fd it
    opened through /proc is closed, not left to the loader's exit."""
    from overmind.shared.segments.memfd import Segment
    from overmind.shared.segments.reductions import DEDUP_MIN_BYTES
    from overmind.warm import dedup

    segment = Segment.create("unmappable", 0)
    segment.seal()
    st = os.fstat(segment.fd)
    digest = "ab" * 16
    index = {"keys": ["k" * 64], "handles": [[[segment.fd, 0, st.st_dev, st.st_ino]]],
             "regions": [[digest, DEDUP_MIN_BYTES, 0, st.st_dev, st.st_ino, 0]]}

    def opened() -> int:
        links = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                links.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:  # listdir's own, closed since
                pass
        return sum("overmind:unmappable" in link for link in links)

    store = dedup.SegmentContents(index, os.getpid())
    try:
        before = opened()
        assert store.find(bytes.fromhex(digest), DEDUP_MIN_BYTES) is None
        assert opened() == before, "the fd opened through /proc was left open"
        assert store.fds == [] and store.holders == []
    finally:
        store.close()
        segment.close()


def test_the_table_unpickler_resolves_persistent_ids_on_this_python():
    # Python 3.13 made an Unpickler instance's persistent_load read-only: Note [Persistent ids
    # across Pythons] in overmind.shared.segments.unpickler.
    import io
    import pickle

    from overmind.shared.segments.unpickler import table_unpickler

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return obj.index if isinstance(obj, _Slot) else None

    buffer = io.BytesIO()
    Pickler(buffer, protocol=5).dump({"a": _Slot(1), "b": [_Slot(0), 3]})
    table = ["zero", object()]
    out = table_unpickler(io.BytesIO(buffer.getvalue()), table).load()
    assert out["a"] is table[1] and out["b"] == ["zero", 3]
    Pickler(buffer := io.BytesIO(), protocol=5).dump(_Slot(5))
    with pytest.raises(IndexError):
        table_unpickler(io.BytesIO(buffer.getvalue()), table).load()


class _Slot:
    def __init__(self, index: int) -> None:
        self.index = index
