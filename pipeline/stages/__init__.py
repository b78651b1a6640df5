"""The DVC stages, one module per stage kind of ``dvc.yaml`` (``python -m pipeline.stages.<stage>``): each
is a pure function and a thin ``main()``. A stage imports the shared helpers beside this folder and
never another stage."""
