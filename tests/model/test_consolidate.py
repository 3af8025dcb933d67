"""A sharded model (DCP) as a model dir (`sft.model.consolidate`, `sft consolidate`)."""

import torch

from sft.model.consolidate import consolidate, file_groups


def test_file_groups_cut_tensors_into_files_of_at_most_the_size_a_larger_one_alone():
    assert file_groups({"a": 3, "b": 3, "c": 5}, 6) == [["a", "b"], ["c"]]
    assert file_groups({"a": 9, "b": 1}, 6) == [["a"], ["b"]]
    assert file_groups({"a": 1}, 6) == [["a"]]


def test_a_sharded_model_consolidates_into_the_models_own_tensors_the_tied_layer_once(tmp_path):
    """The tiny model's state saved as DCP (as FSDP's ranks write it, here from one process), consolidated into 1 and
    into several files: transformers loads either into the same tensors, the tied output layer written once."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from sft.model.loading import load_model

    model = load_model("tiny")
    checkpoint = tmp_path / "checkpoint-1"
    model.config.save_pretrained(checkpoint)
    dcp.save({"model": model.state_dict()}, storage_writer=dcp.FileSystemWriter(str(checkpoint / "shards")),
             no_dist=True)
    one = consolidate(checkpoint / "shards", tmp_path / "one", checkpoint)
    several = consolidate(checkpoint / "shards", tmp_path / "several", checkpoint, max_file_bytes=400_000)
    assert [p.name for p in one] == ["model.safetensors"] and len(several) > 2
    assert "lm_head.weight" not in load_file(one[0]) and model.config.tie_word_embeddings
    for out in ("one", "several"):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / out).state_dict()
        for key, tensor in model.state_dict().items():
            torch.testing.assert_close(loaded[key], tensor, atol=0, rtol=0, msg=f"{out}: {key}")
