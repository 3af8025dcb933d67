"""What the GPU machine's image lacks, carried as wheels (`sft.bench.wheels`): exactly what it lacks or has at a version
a requirer does not take, at this checkout's versions, for CPython 3.12 on x86-64 Linux."""

import zipfile

import pytest

from sft.bench.wheels import IMAGE, IMAGE_BELOW, mismatches, plan, read_pins, write_pins


def test_what_is_carried_is_what_the_image_lacks_or_has_at_a_version_a_requirer_does_not_take():
    """The image's transformers (5.17) is below sft's range and is carried, with what it needs that the image does not
    meet (regex, seen below transformers 5.24's floor); datasets and Hydra are absent and carried with their own needs;
    what the image has at a version every requirer takes (huggingface-hub 1.33, tokenizers 0.23.2) stays; torch never
    travels."""
    from importlib.metadata import version

    required, carry, why = plan()
    carried = {pin.name: pin for pin in carry}
    assert {"transformers", "datasets", "hydra-core", "omegaconf", "antlr4-python3-runtime", "trl", "dill",
            "multiprocess", "regex", "pyarrow", "liger-kernel", "cut-cross-entropy"} == set(carried)
    assert carried["transformers"].version == version("transformers")  # at the version this checkout runs
    assert "transformers==" + version("transformers") + ": the image has 5.17.0, and sft need <5.25,>=5.24" in why
    assert not {"huggingface-hub", "tokenizers", "torch", "numpy", "peft", "accelerate"} & set(carried)
    assert {"huggingface-hub", "tokenizers", "numpy", "peft"} <= set(required)  # needed, and the image's do
    # an image that has it all at the versions here carries nothing; one without regex's bound carries no regex
    everything = {**IMAGE, **{name: pin.version for name, pin in required.items() if pin.version}}
    assert plan(everything, IMAGE_BELOW)[1] == [] or {p.name for p in plan(everything, IMAGE_BELOW)[1]} == {
        "liger-kernel", "cut-cross-entropy"}
    assert "regex" not in {p.name for p in plan(IMAGE, {})[1]}


def test_the_pins_are_what_the_check_on_the_machine_compares_with(tmp_path):
    required, carry, _ = plan()
    pins = read_pins(write_pins(tmp_path, required, carry))
    from importlib.metadata import version

    assert pins["transformers"] == "==" + version("transformers") and pins["huggingface-hub"].startswith(("<", ">"))
    assert "torch" not in pins
    assert mismatches(pins) == []  # this machine has exactly what it carries
    assert mismatches({"transformers": "==5.17.0"}) == [f"transformers: {version('transformers')} installed, wanted "
                                                        "==5.17.0"]


@pytest.mark.slow  # downloads from the package index (12 wheels, about 70 MB) and builds antlr4's
def test_the_wheels_are_for_cpython_3_12_on_linux_and_antlr4_is_built_from_its_source(tmp_path):
    from sft.bench.wheels import gather

    required, carry, _ = plan()
    small = [pin for pin in carry if pin.name in ("antlr4-python3-runtime", "regex", "omegaconf")]
    wheels = gather(tmp_path, small)
    names = sorted(w.name for w in wheels)
    assert len(names) == 3 and names[0].startswith("antlr4_python3_runtime-4.9.3-py3-none-any")
    assert any(name.startswith("regex-") and "cp312-cp312-manylinux" in name for name in names)
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            assert any(n.endswith(".dist-info/METADATA") for n in z.namelist())
