"""Tuned tables keyed by GPU (kernels/_common.py): this GPU's table, else one of the same SM
count and architecture, else none (heuristic plans), each choice but the first said once."""
import json
import logging

from tritonchat.kernels import _common

H200 = {"gpu": "NVIDIA H200", "sm_count": 132, "capability": [9, 0]}
H100 = {"gpu": "NVIDIA H100 80GB HBM3", "sm_count": 132, "capability": [9, 0]}
A100 = {"gpu": "NVIDIA A100-SXM4-80GB", "sm_count": 108, "capability": [8, 0]}


def test_this_gpus_table_else_a_sibling_else_none():
    tables = [dict(A100, entries=["a"]), dict(H200, entries=["h"])]
    assert _common.select_table(tables, H200) == (tables[1], "")
    t, note = _common.select_table(tables, H100)
    assert t is tables[1] and "measured on the NVIDIA H200" in note and "132 SMs" in note
    t, note = _common.select_table(tables, dict(A100, gpu="NVIDIA A800"))
    assert t is tables[0]
    t, note = _common.select_table(tables, {"gpu": "NVIDIA L4", "sm_count": 58, "capability": [8, 9]})
    assert t is None and "no tuned table for the NVIDIA L4 (58 SMs)" in note
    assert _common.select_table(tables, None) == (tables[0], "")   # the interpreter: the first
    untagged = [{"entries": ["u"]}]                                 # a file the tests write
    assert _common.select_table(untagged, A100) == (untagged[0], "")


def test_store_table_replaces_only_this_gpus(tmp_path):
    path = str(tmp_path / "t.json")
    _common.store_table(path, dict(H200, entries=[1]))
    _common.store_table(path, dict(A100, entries=[2]))
    _common.store_table(path, dict(H200, entries=[3]))
    tables = json.loads(open(path).read())["tables"]
    assert sorted((t["gpu"], t["entries"]) for t in tables) == [("NVIDIA A100-SXM4-80GB", [2]),
                                                                ("NVIDIA H200", [3])]


def test_the_choice_is_logged_once(tmp_path, monkeypatch, caplog):
    path = str(tmp_path / "t.json")
    _common.store_table(path, dict(H200, entries=[]))
    monkeypatch.setattr(_common, "gpu_identity", lambda: dict(H100))
    with caplog.at_level(logging.WARNING, logger="tritonchat.kernels"):
        for _ in range(3):
            assert _common.table_for_this_gpu(path)["gpu"] == "NVIDIA H200"
    assert len([r for r in caplog.records if "no tuned table for the NVIDIA H100" in r.getMessage()]) == 1
    _common.clear_table_cache()


def test_packaged_tables_are_tagged_with_their_gpu():
    import pathlib
    for name in ("decode_tuning.json", "prefill_tuning.json"):
        path = pathlib.Path(_common.__file__).with_name(name)
        tables = _common.read_tables(str(path))
        assert tables and all({"gpu", "sm_count", "capability"} <= set(t) for t in tables), name
