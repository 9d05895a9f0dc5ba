"""The folder ``overmind run`` puts on ``PYTHONPATH`` of a run that goes plain: its
``sitecustomize`` teaches the context's warm interpreter what the run imports
(Note [The first run teaches] in overmind.client.first_run.sitecustomize). Nothing to import here."""
