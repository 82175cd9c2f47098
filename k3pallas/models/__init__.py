"""Runnable model blocks that use the k3pallas ops the way JAX inference code does."""
