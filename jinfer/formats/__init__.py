"""Model file formats, one module each: `hf` (Hugging Face directory), `gguf`, `checkpoint`
(jinfer's orbax checkpoint); `params` is what they share (checking named arrays against the
parameter declaration)."""
