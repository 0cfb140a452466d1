"""Dense projections at decode sizes (few rows, large weights): `linear` in api.py."""
