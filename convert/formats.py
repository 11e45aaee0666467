"""What `convert` can write, as plain values (no MLX): the command line offers them as choices before
anything heavy is imported."""

BITS = (2, 3, 4, 5, 6, 8, 16)  # 16: float weights in --dtype
GROUP_SIZES = (32, 64, 128)  # what MLX's affine quantization supports
FLOAT_DTYPE_NAMES = ("bfloat16", "float16", "float32")
DEFAULT_MAX_SHARD = "5GB"
