"""Split Muse Glimmer's channel-framed output into reasoning and answer (the format lives in
`mlx_glimmer.channels`, shared with the server)."""

from ..channels import ENDS, HEADERS, Channels, is_framed, split_channels

__all__ = ["ENDS", "HEADERS", "Channels", "is_framed", "split_channels"]
