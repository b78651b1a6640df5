"""What runs the stages: the ``attnzoo`` command line, the parallel ``repro`` runner (this machine or a
Ray cluster), ``quickstart`` and the DVC remote commands. Nothing here is imported by a stage."""
