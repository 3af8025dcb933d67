"""Tokenizer and causal LM loading, including the embedded `tiny` model built locally without a hub.

`name_or_path: tiny` resolves to a directory under the sft cache holding a small Qwen2-architecture model
(random init, seeded) and a byte-level BPE tokenizer with the ChatML tokens and a Qwen2.5-style chat
template. It is built once, atomically, and from then on loaded through the same Auto classes as a real
checkpoint, so every code path (save, resume, merge) is the one users run on Qwen2.5-7B-Instruct.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from filelock import FileLock

from sft.cache import building, cache_dir
from sft.config.schema import Choice, Schema, config_schema, cuda_available, installed, knob
from sft.files import in_package
from sft.model.tokenizer_ids import IdsFrom

log = logging.getLogger(__name__)

TINY = "tiny"
CHATML_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen2.5's template without tool calls: default system turn, ChatML framing, generation prompt.
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Architecture of the embedded model: small enough to train in minutes on two CPU cores.
TINY_ARCH = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)
TINY_VOCAB_MERGES = 400
TINY_SEED = 0
# The peak learning rate it trains at where trainer.learning_rate is null: a random model this small wants about 100x a
# real one's (sft.training.arguments.learning_rate)
TINY_LEARNING_RATE = 2e-3


def tiny_model_dir() -> Path:
    """Directory of the embedded tiny model, built on first use (safe when several ranks race)."""
    from sft import sample_data

    recipe = json.dumps(
        {"arch": TINY_ARCH, "merges": TINY_VOCAB_MERGES, "seed": TINY_SEED, "template": CHATML_TEMPLATE,
         "corpus": hashlib.sha256(sample_data.TRAIN_FILE.read_bytes()).hexdigest()},
        sort_keys=True,
    )
    target = cache_dir() / f"tiny-qwen2-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):  # ranks of one launch share the cache: one builds, the others wait
        if not (target / "config.json").exists():
            shutil.rmtree(target, ignore_errors=True)  # a dir without config.json would block the rename
            with building(target) as tmp:
                _build_tiny(tmp)
    return target


def _build_tiny(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    from sft import sample_data

    bpe = Tokenizer(models.BPE())
    # Digits one per token, as in Qwen2: arithmetic sees every digit on its own.
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256 + len(CHATML_TOKENS) + TINY_VOCAB_MERGES,
        special_tokens=CHATML_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = []
    for line in sample_data.TRAIN_FILE.read_text(encoding="utf-8").splitlines():
        corpus.extend(m["content"] for m in json.loads(line)["messages"])
    corpus += ["system", "user", "assistant", "You are a helpful assistant."]
    bpe.train_from_iterator(corpus, trainer=trainer)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=TINY_ARCH["max_position_embeddings"],
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(out)

    torch.manual_seed(TINY_SEED)
    vocab = -(-len(tokenizer) // 64) * 64  # padded like real checkpoints' embedding matrices
    config = Qwen2Config(
        vocab_size=vocab,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        **TINY_ARCH,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(out)
    log.info("built the embedded tiny model in %s", out)


class Dtype(Choice):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Quantization(Choice):
    nf4 = "nf4"


@config_schema("model", "model")
@dataclass
class ModelConfig(Schema):
    """The model (`load_model`)."""

    _target_: str = "sft.model.loading.load_model"
    _convert_: str = "all"  # lists and dicts reach transformers' configs as plain Python, not OmegaConf's containers
    name_or_path: str = knob("tiny", "a hub id or a local checkpoint; tiny: the embedded ~0.8M-parameter model")
    gguf_file: Optional[str] = knob(None, "a GGUF file (llama.cpp, Ollama, LM Studio) to train instead of name_or_path: "
                                    "its path, or <package>/<file> inside an installed Python package; converted once "
                                    "into a plain model dir in the sft cache (sft.model.gguf)")
    dtype: Dtype = knob(Dtype.float32, "the weights' dtype")
    attn_implementation: Optional[str] = knob("sdpa", "transformers' (sdpa, eager, flash_attention_2, "
                                              "flex_attention: a document mask for packed rows, CUDA only ...) or "
                                              "sdpa_varlen (each sample of a packed row on its own: PyTorch's "
                                              "varlen flash kernel on a GPU, else sdpa on the samples' slots; "
                                              "sdpa_slots: always the slots)")
    trust_remote_code: bool = knob(False, "run the checkpoint's own modelling code (it is code: trust its source)")
    quantization: Optional[Quantization] = knob(None, "nf4: a 4-bit base for QLoRA (bitsandbytes, CUDA only)")
    # Not null by default: OmegaConf cannot merge a dict from the command line into a null node.
    random_init: Dict[str, Any] = knob(help="a transformers config: this architecture with random weights; empty: "
                                       "load name_or_path's weights", factory=dict)
    config_overrides: Dict[str, Any] = knob(help="fields of the checkpoint's config to change, e.g. "
                                            "+model.config_overrides.output_router_logits=true", factory=dict)
    tiled_mlp_tokens: Optional[int] = knob(None, "compute each MLP in tiles of this many tokens, again in the backward "
                                           "(DeepSpeed ALST's TiledMLP): long rows' largest activation a tile at a "
                                           "time; null: untiled")

    def check(self, cfg=None):
        self.check_source()
        if cfg is not None and cfg.trainer.precision == "pure":
            self.require("dtype", self.dtype == Dtype.float32, "trainer.precision=pure holds the linear layers' "
                         "weights in bf16 and the rest in fp32, as autocast computes them: leave model.dtype=float32")
        if self.quantization is not None and cfg is not None:
            self.require("quantization", cfg.lora is not None, "a quantized base trains only with LoRA (lora=qlora)")
            self.require("quantization", cuda_available(),
                         "4-bit QLoRA needs a CUDA GPU (bitsandbytes); this machine has none: use lora=default")
            self.require("quantization", installed("bitsandbytes"), "needs bitsandbytes: pip install bitsandbytes")
        if self.attn_implementation == "flex_attention" and cfg is not None:
            # its forward runs on a CPU (packed rows get their document mask), its backward does not: a bare
            # NotImplementedError at the first step
            self.require("attn_implementation", cuda_available(), "trains only on a CUDA GPU: PyTorch's FlexAttention "
                         "has no backward on a CPU (torch 2.13); use sdpa (with data.packing=true: sdpa_varlen)")
        self.require("tiled_mlp_tokens", self.tiled_mlp_tokens is None or self.tiled_mlp_tokens >= 1,
                     "must be >= 1 (or null: untiled)")
        if self.tiled_mlp_tokens is not None and cfg is not None:
            # TiledMLP runs a backward per tile: each trainable weight's gradient arrives once per tile, which
            # DeepSpeed is told to wait for; DDP and FSDP2 would reduce it at the first tile
            self.require("tiled_mlp_tokens", cfg.fsdp is None, "is not supported under FSDP2 (which reduces a "
                         "weight's gradient at its first tile): use deepspeed=zero2")
            self.require("tiled_mlp_tokens", bool(cfg.deepspeed) or int(os.environ.get("WORLD_SIZE", "1")) == 1,
                         "with several processes needs DeepSpeed (DDP would reduce a weight's gradient at its first "
                         "tile): add deepspeed=zero2")
            # ZeRO-3 gathers the MLP's weights over the ranks at every tile: ranks with rows of other lengths
            # would make other numbers of gathers and wait on each other for ever
            self.require("tiled_mlp_tokens", (cfg.deepspeed or {}).get("zero_optimization", {}).get("stage") != 3,
                         "is not supported under ZeRO-3, which gathers the MLP's weights at every tile (ranks with "
                         "rows of other lengths would make other numbers of gathers, and hang): use deepspeed=zero2")


    def check_source(self) -> None:
        """The weights are there: a GGUF file, a local dir, the hub's cache or a reachable hub (or random ones)."""
        if self.gguf_file:
            from sft.model.gguf import find_gguf

            self.require("gguf_file", not self.random_init, "and random_init exclude each other: random_init builds "
                         "random weights, gguf_file reads a model's")
            find_gguf(self.gguf_file, self.name_or_path, key="gguf_file")  # the file is there (converting it waits for the model)
        elif not self.random_init and self.name_or_path != TINY:
            check_reachable(self.name_or_path)


@dataclass
class TokenizerConfig(Schema):
    """The tokenizer and what the labelling reads beside it (`load_tokenizer`)."""

    _target_: str = "sft.model.loading.load_tokenizer"
    _convert_: str = "all"  # chat_template_kwargs as plain Python (the template and its saved defaults read them)
    name_or_path: str = knob("${model.name_or_path}", "the model's, by default")
    gguf_file: Optional[str] = knob("${model.gguf_file}", "the model's, by default: the tokenizer and chat template "
                                    "of that GGUF file")
    chat_template: Optional[str] = knob(None, "a chat template to use instead of the tokenizer's: its text, or a "
                                        ".jinja file (a path, or <package>/<file> inside an installed package)")
    trust_remote_code: bool = knob("${model.trust_remote_code}",  # type: ignore[arg-type]
                                   "the model's, by default")
    chat_template_kwargs: Dict[str, Any] = knob(help="keyword arguments the chat template is rendered with, in "
                                                "training and generation (in the data hash): "
                                                "+tokenizer.chat_template_kwargs.enable_thinking=false",
                                                factory=dict)
    stop_tokens: List[str] = knob(help="the tokens an answer ends at, each one token; empty: the model's own (the eos "
                                  "ids of its generation_config.json and the tokenizer's eos_token)", factory=list)
    ids_from: IdsFrom = knob(IdsFrom.checked, "where transformers' class for the model type (Qwen2Tokenizer for any "
                             "qwen2 config) tokenizes otherwise than the dir's own tokenizer.json: checked (refuse, "
                             "naming both), file (the file's ids), class (the class's, logged)")


def resolve(name_or_path: str, gguf_file: str | None = None) -> str:
    """A hub id or local directory as given; `tiny` as the embedded model's directory; with `gguf_file`, the model dir
    converted from that GGUF file (`sft.model.gguf`)."""
    if gguf_file:
        from sft.model.gguf import find_gguf, gguf_model_dir

        return str(gguf_model_dir(find_gguf(gguf_file, name_or_path)))
    return str(tiny_model_dir()) if name_or_path == TINY else name_or_path


def check_reachable(name_or_path: str, key: str = "name_or_path") -> None:
    """A model that is neither a local dir nor in the hub's cache must be downloadable: where the hub is off
    (`HF_HUB_OFFLINE`) or cannot be reached (one request, 5 s at most), one `ConfigError` says so at once, and how to
    point at a local copy (transformers would retry for a minute and then name the tokenizer)."""
    import huggingface_hub
    from huggingface_hub import constants, try_to_load_from_cache

    from sft.config.schema import ConfigError

    if Path(name_or_path).expanduser().is_dir():
        return
    if name_or_path.startswith(("/", ".", "~")) or name_or_path.count("/") > 1:
        raise ConfigError(key, name_or_path, "no such model dir")
    if try_to_load_from_cache(name_or_path, "config.json") is not None:  # downloaded before (a string: its path)
        return
    if constants.HF_HUB_OFFLINE:
        why = "the hub is off (HF_HUB_OFFLINE)"
    else:
        try:
            huggingface_hub.HfApi().model_info(name_or_path, timeout=5)
            return
        except huggingface_hub.errors.RepositoryNotFoundError:
            raise ConfigError(key, name_or_path, f"the hub ({constants.ENDPOINT}) has no such model") from None
        except Exception as e:  # noqa: BLE001 - any failure to reach the hub: no route, DNS, proxy, timeout, 5xx
            why = f"the hub cannot be reached ({type(e).__name__})"
    raise ConfigError(key, name_or_path, f"is not on this machine (no such dir, not in the hub's cache) and {why}: "
                      f"download it where the hub is reachable (hf download {name_or_path} --local-dir <dir>) and set "
                      "model.name_or_path=<dir>, or train a GGUF file: model.gguf_file=<file.gguf>")


def load_tokenizer(name_or_path: str, chat_template: str | None = None, trust_remote_code: bool = False,
                   chat_template_kwargs: dict | None = None, stop_tokens: list[str] | None = None,
                   gguf_file: str | None = None, ids_from: str = "checked"):
    """Load a tokenizer for training: right padding, a pad token, a chat template (`chat_template`: its Jinja text,
    or the path of a `.jinja` file holding it, as llama.cpp keeps them), and the settings the labelling reads
    (`sft.data.chat.settings.configure_chat`): the template's kwargs and the model's stop tokens (those of its
    `generation_config.json` and the tokenizer's eos; `stop_tokens` replaces them). `gguf_file`: the tokenizer of
    that GGUF file (`resolve`). `ids_from`: the class's ids checked against the dir's own `tokenizer.json`, or either
    taken (`sft.model.tokenizer_ids`)."""
    from transformers import AutoTokenizer

    from sft.config.schema import ConfigError
    from sft.data.chat.settings import configure_chat
    from sft.model.tokenizer_ids import check_ids, load_file_tokenizer

    path = resolve(name_or_path, gguf_file)
    if str(ids_from) == "file" and Path(path, "tokenizer.json").is_file():
        tokenizer = load_file_tokenizer(path, trust_remote_code=trust_remote_code)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    tokenizer.padding_side = "right"
    name = f"{name_or_path}'s chat template"
    if chat_template is not None:
        name = "tokenizer.chat_template"
        if chat_template.endswith(".jinja") and "{" not in chat_template:
            file = Path(chat_template).expanduser()
            if not file.is_file():  # <package>/<file>: one shipped in an installed package (sft's own, for a base model)
                file = in_package(chat_template)[0] or file
            try:
                name, chat_template = f"tokenizer.chat_template ({file.name})", file.read_text(encoding="utf-8")
            except OSError as e:
                raise ConfigError("tokenizer.chat_template", chat_template, f"cannot be read ({e.strerror})") from None
        tokenizer.chat_template = chat_template
    if tokenizer.chat_template is None:
        raise ConfigError("tokenizer.chat_template", None, f"tokenizer {name_or_path!r} has no chat template; set "
                          "tokenizer.chat_template (its text, or a .jinja file)")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    check_ids(tokenizer, path, str(ids_from))  # with the chat template the rows are rendered with
    try:
        return configure_chat(tokenizer, chat_template_kwargs, stop_tokens, path, name)
    except ValueError as e:
        raise ConfigError("tokenizer.stop_tokens", list(stop_tokens or []), str(e).split(": ", 1)[-1]) from None


def load_model(
    name_or_path: str,
    dtype: str = "float32",
    attn_implementation: str | None = "sdpa",
    trust_remote_code: bool = False,
    quantization: str | None = None,
    random_init: dict | None = None,
    config_overrides: dict | None = None,
    tiled_mlp_tokens: int | None = None,
    sequence_parallel: int = 1,
    gguf_file: str | None = None,
):
    """Load a causal LM with the Auto classes (the tiny preset included); `quantization=nf4` for QLoRA.

    `attn_implementation` is one of transformers' (`sdpa`, `eager`, `flash_attention_2` ...) or
    `sdpa_varlen` (`sft.model.attention`: sdpa per sample of a packed row). `random_init` (a transformers
    config as a dict, e.g. Qwen2.5-7B's shape; empty or None: load the weights) builds that architecture with random weights instead of
    loading `name_or_path`'s, on the GPU when there is one: benchmarks at full size with no download.
    `config_overrides` changes fields of the model's config (e.g. a mixture of experts' router aux loss:
    `output_router_logits`, `router_aux_loss_coef`); a name the config does not have is refused.
    `tiled_mlp_tokens` computes the MLPs in tiles of that many tokens (`sft.model.tiling`). `sequence_parallel`: the
    ranks that will split each sequence (`sp.size`), whose Ulysses attention splits the heads: checked on the config,
    before any weight is built. `gguf_file`: the weights of that GGUF file, de-quantized (`resolve`).
    """
    import torch
    from transformers import AutoConfig

    if attn_implementation in ("sdpa_varlen", "sdpa_slots"):
        from sft.model import attention

        attention.register()

    extra = {}
    if quantization == "nf4":
        from transformers import BitsAndBytesConfig

        extra["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=getattr(torch, dtype),
        )
    if random_init:
        config = AutoConfig.for_model(**random_init)
    else:
        config = AutoConfig.from_pretrained(resolve(name_or_path, gguf_file), trust_remote_code=trust_remote_code)
    _override_config(config, config_overrides or {})
    if sequence_parallel > 1:
        check_heads_split(config, sequence_parallel)
    model = _load(name_or_path, gguf_file, config, dtype, attn_implementation, trust_remote_code, random_init,
                  config_overrides, extra)
    from sft.model.packing import keep_samples_apart

    if stateful := keep_samples_apart(model):  # each packed sample's state from nothing (a no-op on padded rows)
        if sequence_parallel > 1:
            from sft.config.schema import ConfigError

            raise ConfigError("sp.size", sequence_parallel, f"{type(model).__name__}'s {', '.join(stateful)} carry "
                              "state along the sequence, which sequence parallelism splits over the ranks: not "
                              "supported (sp=none)")
        log.info("model: %s keep the samples of a packed row apart (sft.model.packing)", ", ".join(stateful))
    if tiled_mlp_tokens:
        from sft.model.tiling import tile_mlps

        if not tile_mlps(model, tiled_mlp_tokens):
            from sft.config.schema import ConfigError

            raise ConfigError("model.tiled_mlp_tokens", tiled_mlp_tokens, f"{type(model).__name__} has no dense MLP "
                              "to tile (a decoder layer's mlp, feed_forward or shared_mlp of a class named *MLP, "
                              "without experts): set it to null")
    return model


def may_leave_parameters_unused(config) -> bool:
    """Whether a forward of this model may leave some of its parameters without a gradient: a mixture of experts
    (an expert no token of the batch is routed to) or a model with another modality's tower (a vision or audio
    encoder that text rows never reach). DDP must then look for unused parameters after every backward
    (`find_unused_parameters`); other models need not pay that pass.

        may_leave_parameters_unused(Qwen3MoeConfig())  ->  True      (Qwen2Config())  ->  False
    """
    configs = [config] + [getattr(config, name) for name in ("text_config", "language_config")
                          if getattr(config, name, None) is not None]
    experts = ("num_experts_per_tok", "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    routes = any(isinstance(getattr(c, name, None), int) and getattr(c, name) > 0 for c in configs for name in experts)
    other_modality = any(getattr(config, name, None) is not None for name in ("vision_config", "audio_config"))
    return routes or other_modality


def check_heads_split(config, size: int) -> None:
    """Ulysses gives each of `size` ranks 1/size of the attention heads: the heads must divide by it, and the key/value
    heads too (or `size` by them: each is then repeated)."""
    from sft.config.schema import ConfigError

    text = config.get_text_config()
    heads, kv = text.num_attention_heads, getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    if heads % size or (kv % size and size % kv):
        raise ConfigError("sp.size", size, f"splits the attention heads over {size} ranks: this model has {heads} "
                          f"heads and {kv} key/value heads (each must divide by sp.size, or sp.size by the "
                          "key/value heads)")


def _load(name_or_path, gguf_file, config, dtype, attn_implementation, trust_remote_code, random_init, config_overrides,
          extra):
    import torch
    from transformers import AutoModelForCausalLM

    try:
        if random_init:
            with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
                return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype),
                                                        attn_implementation=attn_implementation)
        return AutoModelForCausalLM.from_pretrained(
            resolve(name_or_path, gguf_file),
            config=config,
            dtype=getattr(torch, dtype),
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
            **extra,
        )
    except ValueError as e:
        from sft.config.schema import ConfigError

        if "is not supported. The only possible arguments are" in str(e):  # a name transformers does not know
            known = [k for k in re.findall(r'"(?:attn_implementation=)?([\w|]+)"', str(e)) if k != attn_implementation]
            raise ConfigError("model.attn_implementation", attn_implementation, f"no such attention (transformers': "
                              f"{', '.join(dict.fromkeys(known))}; sft's: sdpa_varlen, sdpa_slots)") from None
        if "does not support an attention implementation" not in str(e):
            raise

        raise ConfigError("model.attn_implementation", attn_implementation,
                          str(e).split(". Please")[0] + ": use eager (or flash_attention_2 on a GPU)") from e
    except RuntimeError as e:
        if "ignore_mismatched_sizes" not in str(e):
            raise
        from sft.config.schema import ConfigError

        raise ConfigError("model.config_overrides", dict(config_overrides or {}), f"changes the shape of "
                          f"{gguf_file or name_or_path}'s weights, which then cannot load; model.random_init builds another "
                          "shape with random weights") from e


def _override_config(config, overrides: dict) -> None:
    """Set fields of a transformers config; an unknown name is a config error (it would be ignored)."""
    from sft.config.schema import ConfigError

    for name, value in overrides.items():
        if not hasattr(config, name):
            raise ConfigError(f"model.config_overrides.{name}", value,
                              f"{type(config).__name__} has no field {name!r}")
        setattr(config, name, value)
