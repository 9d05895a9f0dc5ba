"""The folder ``overmind run`` puts on ``PYTHONPATH`` of a run that goes plain: its
``sitecustomize`` teaches the context's warm interpreter what the run imports
(Note [The first run teaches] in overmind.client.teach). Nothing to import here."""
