"""The tiny arithmetic checkpoint of tests/train, shared (session scope) with the fault tests."""

from tests.train.conftest import arithmetic_model_dir  # noqa: F401  (a fixture)
