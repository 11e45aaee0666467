"""The Textual chat app (`mlx-glimmer chat`)."""
