"""Native kernels for what XLA compiles poorly on a platform, each called from jitted code."""
