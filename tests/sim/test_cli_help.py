from __future__ import annotations

from extproc.sim.cli import build_parser


def test_sim_help_shows_defaults() -> None:
    text = build_parser().format_help()
    assert "fraction answered 503 (default: 0.0)" in text  # --error-rate
    assert "(default: sha256)" in text  # --prefix-caching-hash-algo
    assert "default: 256" in text  # --max-num-seqs
    assert text.count("default:") >= 20
