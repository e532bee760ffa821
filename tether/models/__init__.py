"""Model layer: load/save any HF causal LM, and a tiny from-scratch factory for the embedded tasks."""
from tether.models.load import load_model, load_tokenizer, resolve_device, resolve_dtype, save_model
from tether.models.tiny import char_tokenizer, make_tiny_model, tiny_config

__all__ = ["load_model", "load_tokenizer", "resolve_device", "resolve_dtype", "save_model",
           "char_tokenizer", "make_tiny_model", "tiny_config"]
