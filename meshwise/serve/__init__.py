"""A checkpoint's model outside training: one unsharded module, export, generation."""
