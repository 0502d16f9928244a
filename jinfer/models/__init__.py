"""Model families as pure forward functions over parameter pytrees (one module per family)."""
