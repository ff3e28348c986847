"""Hugging Face model folders: Llama configs and names, safetensors read slice by slice."""
