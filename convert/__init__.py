"""Checkpoint conversion: HF safetensors / GGUF -> MLX bundle (`mlx-glimmer convert`)."""
