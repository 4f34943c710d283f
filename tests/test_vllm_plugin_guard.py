"""The vLLM plugin's entry point where vLLM cannot be used as tested: it never raises into vLLM's
start, says why in the log, and leaves a record doctor shows (no vLLM needed for these)."""

from __future__ import annotations

import logging
import sys

import pytest

import cpuserve.vllm_plugin as plugin
from cpuserve.vllm_plugin.status import plugin_report, read_status, render_plugin


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("CPUSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(plugin, "_registered", False)
    return tmp_path


def test_an_untested_vllm_version_leaves_vllms_own_path(fresh, monkeypatch, caplog):
    monkeypatch.setattr(plugin, "vllm_version", lambda: "0.1.0")
    with caplog.at_level(logging.INFO, logger="vllm.plugins.cpuserve"):
        plugin.register()
        plugin.register()  # vLLM may call it again: once is enough
    [record] = [r for r in caplog.records if "inactive" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert "vLLM 0.1.0 is not a version this plugin was tested with (0.32.0)" in record.getMessage()
    assert "vllm" not in sys.modules  # nothing of vLLM touched
    status = read_status()
    assert status["active"] is False and status["vllm"] == "0.1.0" and "0.1.0" in status["reason"]


def test_a_failure_while_registering_never_raises_into_vllm(fresh, monkeypatch, caplog):
    monkeypatch.setattr(plugin, "vllm_version", lambda: "0.32.0")
    monkeypatch.setitem(sys.modules, "vllm", None)  # importing vllm fails, as a broken install would
    with caplog.at_level(logging.INFO, logger="vllm.plugins.cpuserve"):
        plugin.register()
    assert any("registering its kernels failed" in r.getMessage() for r in caplog.records)
    assert read_status()["active"] is False and "registering failed" in read_status()["reason"]


def test_doctor_says_whether_vllm_would_load_the_plugin_and_what_it_last_did(fresh, monkeypatch):
    monkeypatch.setattr(plugin, "vllm_version", lambda: "0.1.0")
    plugin.register()
    report = plugin_report({"VLLM_PLUGINS": "lora_filesystem_resolver"})
    assert report["entry_point"]  # ./run setup installs cpuserve with its vllm.general_plugins entry point
    assert report["loads"] is False
    text = "\n".join(render_plugin(report))
    assert "excluded (VLLM_PLUGINS=lora_filesystem_resolver)" in text
    assert "inactive: vLLM 0.1.0 is not a version this plugin was tested with" in text
    assert plugin_report({})["loads"] and plugin_report({"VLLM_PLUGINS": "a,cpuserve"})["loads"]
    assert not plugin_report({"VLLM_PLUGINS": "a, cpuserve"})["loads"]  # vLLM strips no spaces


def test_the_schemes_it_takes_are_chosen_by_environment_and_bad_values_are_refused(fresh, monkeypatch, caplog):
    assert plugin.schemes_wanted({}) == ("w4a8", "w8a8")
    assert plugin.schemes_wanted({"CPUSERVE_VLLM_SCHEMES": " W4A8 "}) == ("w4a8",)
    for bad in ("w4a16", "", "w8a8,int3"):
        with pytest.raises(ValueError, match="expected a comma-separated subset of w4a8, w8a8"):
            plugin.schemes_wanted({"CPUSERVE_VLLM_SCHEMES": bad})
    monkeypatch.setattr(plugin, "vllm_version", lambda: "0.32.0")
    monkeypatch.setenv("CPUSERVE_VLLM_SCHEMES", "w4a16")
    with caplog.at_level(logging.INFO, logger="vllm.plugins.cpuserve"):
        plugin.register()  # an error in the log and vLLM's own path, never a crash
    assert any(r.levelno == logging.ERROR and "CPUSERVE_VLLM_SCHEMES='w4a16'" in r.getMessage() for r in caplog.records)
    assert read_status()["active"] is False
