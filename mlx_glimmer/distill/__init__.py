"""`mlx-glimmer distill`: train a DFlash drafter for any target on its own responses."""
