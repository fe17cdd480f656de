"""Per-pass dumps: folders, files a person can read, the index page, WMOE_DUMP_DIR, the CLI."""

from __future__ import annotations

import json
import os
import stat

import networkx as nx
import pytest
import torch

import wmoe_compile as wc
from wmoe_compile.cli import main
from wmoe_compile.models import build_model
from wmoe_compile.pipeline import example_inputs_for

PASS_FOLDERS = [
    "00_input",
    "01_find_sites",
    "02_insert_dwt_quantize",
    "03_swap_wavelet_attention",
    "04_replace_moe_dispatch",
    "05_fuse_sibling_linears",
    "06_decompose_router_topk",
    "07_cleanup_graph",
    "08_overlap_cache_writes",
]


@pytest.fixture(autouse=True)
def _reference_ops(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the dumps are under test, not the kernels


@pytest.fixture(scope="module")
def captured():
    model = build_model("tiny", num_layers=1)
    model.setup_cache(1, 16)
    args, _ = example_inputs_for(model, 1, 4)
    return torch.export.export(model, args), args


def test_every_pass_gets_a_folder_with_readable_files(tmp_path, captured):
    program, args = captured
    _, report = wc.transform(program, wc.CompileConfig(bypass_codec=True), dump_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == PASS_FOLDERS
    for folder in PASS_FOLDERS:
        path = tmp_path / folder
        for name in ("graph.py", "nodes.txt", "graph.json", "diff.txt", "sites.json", "graph.dot"):
            assert (path / name).exists(), f"{folder}/{name} missing"
        graph = nx.node_link_graph(json.loads((path / "graph.json").read_text()), edges="edges")
        assert graph.number_of_nodes() == len((path / "nodes.txt").read_text().splitlines()) - 1
    rewrite = (tmp_path / "02_insert_dwt_quantize" / "diff.txt").read_text()
    assert "+" in rewrite and "kv_compress_into_cache" in rewrite and "-" in rewrite
    assert (tmp_path / "01_find_sites" / "diff.txt").read_text() == ""  # analysis changes nothing
    table = (tmp_path / "04_replace_moe_dispatch" / "nodes.txt").read_text()
    assert "wmoe::tiled_moe" in table and "layer 0 moe" in table  # inserted nodes carry their site
    sites = json.loads((tmp_path / "07_cleanup_graph" / "sites.json").read_text())
    assert {s["status"] for s in sites} == {"rewritten"}


def test_index_page_shows_node_deltas_and_sites(tmp_path, captured):
    program, _ = captured
    _, report = wc.transform(program, wc.CompileConfig(), dump_dir=tmp_path)
    page = (tmp_path / "index.html").read_text()
    assert page.startswith("<!doctype html>")
    for record in report.passes:
        assert record.name in page
        assert f"{record.nodes_before} &rarr; {record.nodes_after}" in page
    assert "+1 wmoe.tiled_moe" in page  # the op added by replace_moe_dispatch
    for site in report.sites:
        assert site.module_path in page and site.status in page
    assert json.loads((tmp_path / "report.json").read_text())["sites"]


def test_dump_dir_from_environment(tmp_path, captured, monkeypatch):
    program, _ = captured
    monkeypatch.setenv("WMOE_DUMP_DIR", str(tmp_path / "env"))
    _, report = wc.transform(program, wc.CompileConfig(compress_kv=False, replace_moe=False))
    assert report.dump_dir == str(tmp_path / "env")
    assert (tmp_path / "env" / "index.html").exists()


def test_picture_is_drawn_when_graphviz_is_present(tmp_path, captured, monkeypatch):
    # A stand-in `dot` on PATH: records its arguments and writes the output file it is asked for.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_dot = bin_dir / "dot"
    fake_dot.write_text('#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\necho "<svg/>" > "$2"\n')
    fake_dot.chmod(fake_dot.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    program, _ = captured
    wc.transform(program, wc.CompileConfig(compress_kv=False, replace_moe=False), dump_dir=tmp_path / "d")
    assert (tmp_path / "d" / "00_input" / "graph.svg").read_text().strip() == "<svg/>"
    assert "01_find_sites/graph.svg" in (tmp_path / "d" / "index.html").read_text()


def test_cli_dump_reference_model(tmp_path, capsys):
    assert main(["dump", "--model", "tiny-mixtral", "--layers", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "index.html" in out and "rewritten" in out
    assert (tmp_path / "index.html").exists() and (tmp_path / "07_cleanup_graph" / "graph.py").exists()


def test_cli_dump_hf_config_path(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    config.save_pretrained(tmp_path / "model")
    code = main(["dump", "--model", str(tmp_path / "model" / "config.json"), "--out", str(tmp_path / "d")])
    assert code == 0
    assert "kv_write" in capsys.readouterr().out
    assert (tmp_path / "d" / "index.html").exists()


def test_cli_dump_unknown_model_fails_clearly(tmp_path, capsys):
    assert main(["dump", "--model", "no-such-model", "--out", str(tmp_path)]) == 2
    assert "valid: tiny-mixtral" in capsys.readouterr().err
