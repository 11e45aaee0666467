"""A cached demo bundle follows the drafter the installed version ships."""

import filecmp

from mlx_glimmer.demo import SHIPPED_DRAFTER, refresh_drafter


def test_a_cached_bundle_with_another_drafter_gets_the_shipped_one(tmp_path):
    bundle = tmp_path / "demo"
    (bundle / "drafter").mkdir(parents=True)
    (bundle / "drafter" / "model.safetensors").write_bytes(b"an older drafter")
    (bundle / "drafter" / "config.json").write_text("{}")
    assert refresh_drafter(bundle)
    for f in SHIPPED_DRAFTER.iterdir():
        assert filecmp.cmp(f, bundle / "drafter" / f.name, shallow=False)
    assert sorted(p.name for p in bundle.iterdir()) == ["drafter"]  # nothing staged is left behind
    assert not refresh_drafter(bundle)  # already current: untouched
