"""A LoRA adapter is identified by its files' contents: an adapter retrained in place, anywhere
in its folder, whatever the size of its files, is another adapter and never reads the old one's
entries; an adapter whose files are not on this machine is neither looked up nor saved.

Real folders and files; vLLM's request objects stand in as plain namespaces (only the fields the
connector reads)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from galahad.adapters.vllm.identity import _lora_identity, bypass_reason  # noqa: E402


def _adapter(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    (folder / "adapter_model.safetensors").write_bytes(b"\x01" * 4096)
    return folder


def _lora(path: str, name: str = "support") -> SimpleNamespace:
    return SimpleNamespace(lora_name=name, lora_int_id=1, lora_path=path)


def _request(lora: SimpleNamespace | None) -> SimpleNamespace:
    return SimpleNamespace(prompt_token_ids=[5] * 300, prompt_embeds=None, pooling_params=None,
                           lora_request=lora)


def test_an_adapter_retrained_in_place_is_another_adapter(tmp_path: Path) -> None:
    folder = _adapter(tmp_path / "adapter")
    before = _lora_identity(_lora(str(folder)))
    (folder / "adapter_model.safetensors").write_bytes(b"\x02" * 4096)  # same name, same size
    after = _lora_identity(_lora(str(folder)))
    assert before is not None and after is not None and before != after


def test_a_file_in_a_subfolder_is_part_of_the_identity(tmp_path: Path) -> None:
    folder = _adapter(tmp_path / "adapter")
    (folder / "weights").mkdir()
    (folder / "weights" / "extra.pt").write_bytes(b"a" * 100)
    before = _lora_identity(_lora(str(folder)))
    (folder / "weights" / "extra.pt").write_bytes(b"b" * 100)
    assert _lora_identity(_lora(str(folder))) != before


def test_a_weight_file_of_a_gibibyte_or_more_is_hashed_whole(tmp_path: Path) -> None:
    folder = _adapter(tmp_path / "adapter")
    big = folder / "adapter_model.bin"
    with open(big, "wb") as f:  # sparse: 1 GiB on paper, a few blocks on disk
        f.truncate(1 << 30)
    before = _lora_identity(_lora(str(folder)))
    with open(big, "r+b") as f:
        f.seek((1 << 30) - 1)
        f.write(b"\x01")
    os.utime(big, ns=(1, 1))  # even with its times put back (the inode's change time is not)
    assert _lora_identity(_lora(str(folder))) != before


def test_the_same_files_give_the_same_identity_in_any_folder(tmp_path: Path) -> None:
    a = _lora_identity(_lora(str(_adapter(tmp_path / "a"))))
    b = _lora_identity(_lora(str(_adapter(tmp_path / "b"))))
    assert a == b is not None
    assert _lora_identity(_lora(str(tmp_path / "a"), name="other")) != a  # the name counts too


@pytest.mark.parametrize("path", ["acme/support-lora", "/nowhere/adapter", ""])
def test_an_adapter_not_on_this_machine_is_bypassed_not_keyed_by_its_name(path: str) -> None:
    """A hub name not downloaded here, a folder gone, no path: two different adapters could carry
    that name or id, so their requests are neither looked up nor saved."""
    request = _request(_lora(path))
    assert bypass_reason(request) == "a LoRA adapter whose files are not on this machine"
    assert bypass_reason(_request(None)) == ""
