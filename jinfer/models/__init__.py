"""Model families and what they share. `family.py`: the `Family` value and the registry that finds
one from a checkpoint; the Llama family in `llama.py` (its pass), `llama_params.py` (its weights'
declaration) and `llama_checkpoints.py` (how its checkpoints name things). Shared by any family:
`params.py` (what follows from a declaration), `linear.py` (products, however a weight is held),
`attention.py`, `rope.py`, `quantized.py`."""
