"""What MLflow runs to load a registered version: MLflow's models-from-code, so a registered model
is this file, the serving package and the version's files, and never a pickle. ``publish`` logs it
with ``model_config={"name": ..., "version": ...}`` (:class:`serving.pyfunc.PublishedModel`)."""

import mlflow

from serving.pyfunc import PublishedModel

mlflow.models.set_model(PublishedModel())
