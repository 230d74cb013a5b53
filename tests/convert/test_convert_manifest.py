"""Checksum manifests of our checkpoint directories: written by every save / conversion / export,
equal to an independent blake2b of each array, checked on load by default; one flipped byte (same
file size) fails the load naming the tensor; a checkpoint without a manifest loads with one line."""

import json
import os

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from minimax_jax.convert.errors import ChecksumMismatch
from minimax_jax.convert.export import export_orbax_to_hf
from minimax_jax.convert.hf_to_orbax import convert_hf_to_orbax
from minimax_jax.convert.load import load_checkpoint
from minimax_jax.convert.manifest import MANIFEST_FILE, leaf_name
from minimax_jax.convert.save import save_checkpoint
from minimax_jax.data.tokenizer import save_tokenizer
from tests import hf_fixtures as hf
from tests import infer_helpers as H
from tests.checkpoint_helpers import blake2b_hex, flip_byte_of
from tests.convert import test_convert_fixtures as fx
from tests.train_helpers import random_params


def _manifest(d):
    with open(os.path.join(d, MANIFEST_FILE)) as f:
        return json.load(f)


def _flat(tree):
    return {leaf_name(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.fixture()
def saved(tmp_path):
    cfg = H.tiny_config(64)
    params = random_params(cfg)
    d = str(tmp_path / "ckpt")
    save_checkpoint(params, cfg, d, dtype="float32")
    return d, _flat(params)


def test_manifest_holds_an_independent_digest_of_every_leaf(saved):
    d, leaves = saved
    m = _manifest(d)
    assert m["format"] == "minimax-jax manifest v1" and m["hash"] == "blake2b-128"
    assert set(m["tensors"]) == set(leaves)
    for name, arr in leaves.items():
        e = m["tensors"][name]
        assert (e["shape"], e["dtype"], e["digest"]) == (list(arr.shape), "float32", blake2b_hex(arr)), name


def test_flipped_byte_fails_the_load_naming_the_tensor(saved, capfd):
    d, leaves = saved
    flip_byte_of(os.path.join(d, "params"), leaves["lm_head"])
    with pytest.raises(ChecksumMismatch) as e:
        load_checkpoint(d)
    assert str(e.value).startswith(f"checkpoint {d}: tensor 'lm_head' checksum mismatch (file flipped or truncated)")
    assert e.value.tensor == "lm_head"
    with pytest.raises(ChecksumMismatch, match="'lm_head'"):          # also when a cast is asked for
        load_checkpoint(d, dtype="bfloat16")
    _, params = load_checkpoint(d, verify=False)                       # the opt-out loads the damaged bytes
    assert not np.array_equal(np.asarray(params["lm_head"]), leaves["lm_head"])
    assert capfd.readouterr().err == ""


def test_infer_loading_names_the_corrupt_tensor(tmp_path):
    from minimax_jax.infer.loading import load_model

    cfg = H.tiny_config(300)
    params = random_params(cfg)
    d = str(tmp_path / "ckpt")
    save_tokenizer(H.tiny_tokenizer(), str(tmp_path / "tok"))
    save_checkpoint(params, cfg, d, dtype="float32", tokenizer=str(tmp_path / "tok" / "tokenizer.json"))
    flip_byte_of(os.path.join(d, "params"), params["embed"]["embedding"])
    with pytest.raises(ChecksumMismatch, match="tensor 'embed.embedding' checksum mismatch"):
        load_model(d, log=lambda _: None)
    assert load_model(d, log=lambda _: None, verify=False).cfg.vocab_size == 300


def test_verified_cast_and_old_checkpoint_warning(saved, capfd):
    d, leaves = saved
    _, params = load_checkpoint(d, dtype="bfloat16")
    assert params["lm_head"].dtype == jax.numpy.bfloat16
    np.testing.assert_array_equal(np.asarray(params["lm_head"], np.float32),
                                  leaves["lm_head"].astype(jax.numpy.bfloat16).astype(np.float32))
    assert capfd.readouterr().err == ""
    os.remove(os.path.join(d, MANIFEST_FILE))              # as written before manifests existed
    _, params = load_checkpoint(d)
    err = capfd.readouterr().err
    assert err == f"warning: checkpoint {d} has no {MANIFEST_FILE} (written by an older version): loaded without " \
                  "checksum verification\n"
    np.testing.assert_array_equal(np.asarray(params["lm_head"]), leaves["lm_head"])


def test_conversion_and_export_write_and_check_manifests(tmp_path):
    hf.require_hf()
    src = fx.saved_pretrained(hf.m2_model(5), str(tmp_path / "hf"))
    convert_hf_to_orbax(src, tmp_path / "ours", "float32", progress=False)
    _, params = load_checkpoint(tmp_path / "ours")
    leaves = _flat(params)
    m = _manifest(tmp_path / "ours")
    assert m["writer"] == "convert" and set(m["tensors"]) == set(leaves)
    for name, arr in leaves.items():
        assert m["tensors"][name]["digest"] == blake2b_hex(arr), name

    # the HF export records the digest of every tensor it wrote
    export_orbax_to_hf(tmp_path / "ours", tmp_path / "back", progress=False)
    tensors = {}
    for f in os.listdir(tmp_path / "back"):
        if f.endswith(".safetensors"):
            tensors.update(load_file(str(tmp_path / "back" / f)))
    em = _manifest(tmp_path / "back")["tensors"]
    assert set(em) == set(tensors)
    for name, arr in tensors.items():
        assert em[name]["digest"] == blake2b_hex(arr), name

    # a flipped byte in a stacked (per-layer) leaf of the conversion: load and export both refuse it
    name = "segments.0.attn.q_proj"
    flip_byte_of(str(tmp_path / "ours" / "params"), leaves[name][1])
    with pytest.raises(ChecksumMismatch, match=f"tensor '{name}' checksum mismatch"):
        load_checkpoint(tmp_path / "ours")
    with pytest.raises(ChecksumMismatch, match=f"tensor '{name}' checksum mismatch"):
        export_orbax_to_hf(tmp_path / "ours", tmp_path / "back2", progress=False)
    assert not (tmp_path / "back2").exists() and not [p for p in os.listdir(tmp_path) if ".partial-" in p]


def test_a_manifest_without_a_restored_tensor_fails_naming_it():
    """A flipped byte in a tensor NAME of the manifest must not leave that tensor silently unverified."""
    from minimax_jax.convert.errors import ChecksumMismatch
    from minimax_jax.convert.manifest import manifest_dict, tree_entries, verify_tree
    tree = {"a": np.arange(6, dtype=np.float32), "b": np.ones((2, 3), np.float32)}
    m = manifest_dict(tree_entries(tree), writer="test")
    assert verify_tree(tree, m, "x") == 2
    m["tensors"]["c"] = m["tensors"].pop("b")                     # the entry's name damaged
    with pytest.raises(ChecksumMismatch, match="tensor 'b' has no entry in the manifest"):
        verify_tree(tree, m, "x")
