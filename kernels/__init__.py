"""Compute kernels. Each op is a folder: `api.py` (the one public function, picks a backend), `reference.py`
(plain jnp, the truth), and one file per Pallas backend. Nothing here imports the model."""
