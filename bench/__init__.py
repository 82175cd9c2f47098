"""The k3pallas benchmark (``python -m bench``) and tuning sweep (``python -m bench.tune``)."""
