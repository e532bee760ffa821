"""Where a real chat model (SmolLM2-135M-Instruct, run against TRL) tests what a tiny one cannot:
reward functions get message lists for chat prompts, BOS only where the tokenizer puts it, DPO's
first step has exactly zero margins, max_steps=0 is refused, columns are mapped from the CLI,
metrics.jsonl has no empty rows, and checkpoints keep the model's own dtype."""

import json

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer, decoders, models, processors
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from tether.config import ConfigError, load_config
from tether.data import DataError, bos_ids, encode_prompt_completion, encode_prompts
from tether.models import load_tokenizer, make_tiny_model
from tether.models.tiny import char_tokenizer
from tether.rewards.learned import encode_scored
from tether.rewards.scoring import score
from tether.rollout.engine import Sampler
from tether.rollout.sampling import SamplingConfig
from tether.run import MASTER_WEIGHTS, RunDir, read_jsonl
from tether.trainers.best_of_n import BoNConfig, run_bon
from tether.trainers.preference.offline import DPOConfig, train_offline
from tether.trainers.grpo import GRPOConfig, train_grpo
from tether.trainers.sft import SFTConfig, train_sft
from tether.trainers.sft import load_sft_data

TINY = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()  # 2 shared cores: one thread keeps tiny runs steady
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("friction")
    make_tiny_model(root / "model", **TINY)
    return root


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ---- 1. reward functions get message lists for chat prompts (TRL's convention) -------------------

def trl_style(prompts, completions, completion_ids=None, **_):
    """A reward written for TRL's conversational data."""
    return [float(len(c[0]["content"])) for c in completions]


def test_score_passes_message_lists_for_chat_prompts_and_strings_for_plain_ones():
    chat = [{"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"},
            {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
             "answer": "x"}]
    seen = {}

    def record(prompts, completions, completion_ids=None, **cols):
        seen.update(prompts=prompts, completions=completions, cols=cols)
        return [0.0] * len(completions)

    per_fn, total = score([trl_style, record], [1.0, 1.0], chat, ["four", "hello!"], [[1], [2]])
    assert total.tolist() == [4.0, 6.0] and per_fn[:, 0].tolist() == [4.0, 6.0]
    assert seen["prompts"] == [r["prompt"] for r in chat]
    assert seen["completions"] == [[{"role": "assistant", "content": "four"}],
                                   [{"role": "assistant", "content": "hello!"}]]
    assert seen["cols"] == {"answer": ["4", "x"]}

    plain = [{"prompt": "2+2?", "answer": "4"}]
    score([record], [1.0], plain, ["four"], [[1]])
    assert seen["prompts"] == ["2+2?"] and seen["completions"] == ["four"]


def test_grpo_reward_functions_see_message_lists_for_conversational_prompts(root):
    data = write_jsonl(root / "chat.jsonl", [{"prompt": [{"role": "user", "content": f"Say {i}"}]}
                                             for i in range(4)])
    seen = []

    def record(prompts, completions, completion_ids=None, **_):
        seen.append((prompts, completions))
        return trl_style(prompts, completions)

    train_grpo(GRPOConfig(model=str(root / "model"), data=data, runs_dir=str(root / "runs"), name="chat-grpo",
                          batch_size=2, num_generations=2, max_new_tokens=4, max_steps=1, device="cpu",
                          progress=False), reward_funcs=[record])
    prompts, completions = seen[0]
    assert all(isinstance(p, list) and p[0]["role"] == "user" for p in prompts)
    assert all(isinstance(c, list) and len(c) == 1 and c[0]["role"] == "assistant"
               and isinstance(c[0]["content"], str) for c in completions)


def test_best_of_n_reward_functions_see_message_lists_and_rft_data_stays_conversational(tmp_path):
    make_tiny_model(tmp_path / "m", **TINY)
    data = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": w}]}
                                                 for w in ("ab", "xyz")])
    cfg = BoNConfig(model=str(tmp_path / "m"), data=data, n=2, max_new_tokens=4, runs_dir=str(tmp_path),
                    device="cpu", dtype="fp32", rft=True, rft_epochs=1.0)
    run_bon(cfg, reward_funcs=[trl_style])
    rft = [json.loads(line) for line in (tmp_path / "bon" / "rft.jsonl").read_text().splitlines()]
    assert len(rft) == 2
    for row in rft:  # an SFT row: a chat prompt's completion is an assistant message
        assert isinstance(row["prompt"], list) and row["completion"][0]["role"] == "assistant"


# ---- 2. BOS only where the tokenizer itself puts it ---------------------------------------------

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]


def _char_tokenizer(bos: str, post_bos: bool) -> PreTrainedTokenizerFast:
    vocab = {t: i for i, t in enumerate(SPECIALS + list("abcdefghijklmnopqrstuvwxyz \n:?"))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIALS)
    if post_bos:  # Llama: the post-processor starts every text with <s>
        backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, vocab[bos])])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token="</s>"
                                  if bos == "<s>" else "<|im_end|>", pad_token="<pad>", unk_token="<unk>",
                                  add_bos_token=post_bos)
    return tok


def test_chatml_tokenizer_gets_no_bos_on_plain_text_and_llama_like_gets_one():
    chatml = _char_tokenizer("<|im_start|>", post_bos=False)  # SmolLM2: bos = <|im_start|>, never prepended
    llama = _char_tokenizer("<s>", post_bos=True)
    assert chatml("hi")["input_ids"][:1] != [chatml.bos_token_id]  # the premise: HF adds none
    assert bos_ids(chatml) == [] and bos_ids(llama) == [llama.bos_token_id]

    row = {"prompt": "\n\nhuman: hi", "completion": " yo"}
    ids = encode_prompt_completion(row, chatml)["input_ids"]
    assert chatml.decode(ids) == "\n\nhuman: hi yo<|im_end|>"
    ids = encode_prompt_completion(row, llama)["input_ids"]
    assert llama.decode(ids) == "<s>\n\nhuman: hi yo</s>"
    # the same for prompt-only rows, the reward model's encoding and the sampler's string prompts
    (p,), _ = encode_prompts([{"prompt": "hi"}], chatml)
    assert p["prompt_ids"] == chatml("hi", add_special_tokens=False)["input_ids"]
    assert encode_scored(chatml, "hi", " yo")[0] != chatml.bos_token_id
    assert encode_scored(llama, "hi", " yo")[0] == llama.bos_token_id
    model, cfg = make_tiny_model(None, **TINY)[0], SamplingConfig()  # add_bos=True: where the tokenizer would
    assert Sampler(model, chatml)._encode("hi", cfg) == chatml("hi", add_special_tokens=False)["input_ids"]
    assert Sampler(model, llama)._encode("hi", cfg) == llama("hi")["input_ids"]


def test_tiny_tokenizers_keep_their_bos_through_a_save_and_load(tmp_path):
    """The quickstart's numbers depend on it: the char tokenizer adds <bos> itself, so plain text
    still starts with it, once."""
    tok = char_tokenizer()
    tok.save_pretrained(tmp_path)
    for t in (tok, load_tokenizer(str(tmp_path))):
        assert bos_ids(t) == [t.bos_token_id]
        ids = encode_prompt_completion({"prompt": "1+2=", "completion": "3"}, t)["input_ids"]
        assert ids == [t.bos_token_id] + t("1+2=3", add_special_tokens=False)["input_ids"] + [t.eos_token_id]
        assert encode_prompt_completion({"prompt": "<bos>1+2=", "completion": "3"}, t)["input_ids"] == ids


# ---- 3. DPO: at step 1 the reference and the policy see the same batches ------------------------

@pytest.mark.parametrize("batch_size,grad_accum", [(4, 1), (3, 2)])
def test_dpo_step_one_has_exactly_zero_margins(root, batch_size, grad_accum):
    rows = [{"prompt": f"{w}=", "chosen": w, "rejected": w[::-1] + "q" * (i % 3)}
            for i, w in enumerate(["abcd", "efghij", "klm", "nopqrs", "tuv", "wxyzab", "cdefg", "hij",
                                   "klmnop", "qrs", "tuvwx", "yzabcde", "fgh", "ijklmn", "opq", "rstuvw"])]
    data = write_jsonl(root / "pairs.jsonl", rows)
    name = f"dpo-{batch_size}-{grad_accum}"
    train_offline(DPOConfig(model=str(root / "model"), data=data, runs_dir=str(root / "runs"), name=name,
                            device="cpu", progress=False, batch_size=batch_size, grad_accum=grad_accum,
                            log_every=1, lr=1e-3, max_steps=2))
    first = read_jsonl(root / "runs" / name / "metrics.jsonl")[0]
    assert first["step"] == 1
    # policy = reference before any update: log-ratios exactly 0, so ties everywhere (counted wrong)
    assert first["rewards/chosen"] == 0.0 and first["rewards/rejected"] == 0.0
    assert first["rewards/margins"] == 0.0 and first["rewards/accuracies"] == 0.0
    # 6. no eval set: the final (empty) evaluation writes no row
    assert all(set(r) - {"step", "time"} for r in read_jsonl(root / "runs" / name / "metrics.jsonl"))


# ---- 4. max_steps=0 ------------------------------------------------------------------------------

def test_max_steps_zero_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="max_steps must be >= 1, or -1") as e:
        load_config(SFTConfig, overrides=["max_steps=0"])
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="max_steps must be >= 1"):
        SFTConfig(model="m", data="d", max_steps=0)
    assert load_config(SFTConfig, overrides=["max_steps=-1"]).optim.max_steps == -1


def test_offloading_a_replicated_model_is_refused_in_one_line():
    # fsdp=false has no shards to offload; silently ignoring the option would put the whole state
    # on every GPU
    with pytest.raises(ConfigError, match="fsdp_offload=true .* needs fsdp=true") as e:
        load_config(SFTConfig, overrides=["fsdp=false", "fsdp_offload=true"])
    assert "\n" not in str(e.value)
    assert load_config(SFTConfig, overrides=["fsdp_offload=true"]).model.fsdp_offload


# ---- 5. column mapping from the command line -----------------------------------------------------

GSM8K = [{"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
         {"question": "What is 6 times 7?", "answer": "6 * 7 = 42\n#### 42"}]


def test_columns_map_gsm8k_for_sft(root):
    data = write_jsonl(root / "gsm8k.jsonl", GSM8K)
    cfg = load_config(SFTConfig, overrides=[f"model={root / 'model'}", f"data={data}",
                                            "columns={question: prompt, answer: completion}"])
    assert cfg.data.columns == {"question": "prompt", "answer": "completion"}
    tok = load_tokenizer(str(root / "model"))
    train, *_ = load_sft_data(cfg, tok)
    ex = train[0]
    target = [t for t, m in zip(ex["input_ids"], ex["completion_mask"]) if m]
    assert tok.decode(target, skip_special_tokens=True) == GSM8K[0]["answer"]
    with pytest.raises(DataError, match="gsm8k.jsonl: expected columns .* found question, answer"):  # unmapped
        load_sft_data(load_config(SFTConfig, overrides=[f"model={root / 'model'}", f"data={data}"]), tok)


def test_columns_map_gsm8k_for_grpo_and_the_answer_reaches_the_reward(root):
    data = write_jsonl(root / "gsm8k-rl.jsonl", GSM8K)
    cfg = load_config(GRPOConfig, overrides=[f"model={root / 'model'}", f"data={data}", "columns={question: prompt}",
                                             f"runs_dir={root / 'runs'}", "name=gsm8k-grpo", "batch_size=2",
                                             "num_generations=2", "max_new_tokens=4", "max_steps=1",
                                             "device=cpu", "progress=false"])
    seen = {}

    def record(prompts, completions, completion_ids=None, **cols):
        seen.update(prompts=prompts, cols=cols, completions=completions)
        return [0.0] * len(completions)

    train_grpo(cfg, reward_funcs=[record])
    assert sorted(set(seen["prompts"])) == sorted(r["question"] for r in GSM8K)
    by_prompt = {r["question"]: r["answer"] for r in GSM8K}
    assert seen["cols"]["answer"] == [by_prompt[p] for p in seen["prompts"]]
    assert all(isinstance(c, str) for c in seen["completions"])  # plain prompts: plain completions


def test_bad_column_mappings_are_one_line(root):
    data = write_jsonl(root / "gsm8k-bad.jsonl", [{**r, "prompt": "x"} for r in GSM8K])
    tok = load_tokenizer(str(root / "model"))

    def load(columns):
        return load_sft_data(SFTConfig(model=str(root / "model"), data=data, columns=columns), tok)
    with pytest.raises(DataError, match=r"gsm8k-bad.jsonl:quest:.*does not have") as e:
        load({"quest": "prompt"})
    assert "\n" not in str(e.value)
    with pytest.raises(DataError, match=r"gsm8k-bad.jsonl:prompt:.*already has"):
        load({"question": "prompt", "answer": "completion"})
    with pytest.raises(ConfigError, match="two columns onto 'prompt'"):
        load_config(SFTConfig, overrides=["columns={question: prompt, answer: prompt}"])


# ---- 6. metrics.jsonl has no rows without metrics -------------------------------------------------

def test_a_log_call_without_metrics_writes_no_row(tmp_path):
    run = RunDir(tmp_path / "r")
    run.log(1, {"loss": 1.0})
    run.log(2, {})
    run.log(3, {"eval/note": "text is not a metric"})
    run.log(4, {"loss": float("nan")})  # a metric that is not finite is still a row (as null)
    assert [(r["step"], r.get("loss", "-")) for r in run.read_metrics()] == [(1, 1.0), (4, None)]


# ---- 7. checkpoints in the model's own dtype -----------------------------------------------------

def _weights_dtypes(ckpt):
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        return {f.get_tensor(k).dtype for k in f.keys()}


@pytest.fixture(scope="module")
def bf16_model(root):
    """The tiny model stored as bf16, as SmolLM2 is published."""
    model = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.bfloat16)
    model.save_pretrained(root / "model-bf16")
    load_tokenizer(str(root / "model")).save_pretrained(root / "model-bf16")
    return root / "model-bf16"


def _sft(root, model, name, **kw):
    data = write_jsonl(root / "copy.jsonl", [{"prompt": f"{w}:", "completion": f" {w}"}
                                             for w in ("abc", "de", "fghi", "jk", "lmn", "op", "qrs", "tuvw")])
    return train_sft(SFTConfig(model=str(model), data=data, runs_dir=str(root / "runs"), name=name,
                               device="cpu", dtype="fp32", progress=False, batch_size=2, lr=1e-3,
                               schedule="constant", warmup_steps=0, warmup_ratio=0.0, log_every=1,
                               num_samples=0, **kw))


def test_fp32_master_weights_of_a_bf16_model_are_saved_as_bf16_and_resume_exactly(root, bf16_model):
    full = _sft(root, bf16_model, "bf16-full", max_steps=4)
    ckpt = root / "runs" / "bf16-full" / "checkpoints" / "step-4"
    assert full["checkpoint"] == str(ckpt)
    assert _weights_dtypes(ckpt) == {torch.bfloat16}
    assert json.loads((ckpt / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(ckpt).dtype == torch.bfloat16  # loads as published
    assert (ckpt / MASTER_WEIGHTS).exists()

    _sft(root, bf16_model, "bf16-cut", max_steps=2)
    _sft(root, bf16_model, "bf16-cut", max_steps=4, resume=True)
    cut = root / "runs" / "bf16-cut" / "checkpoints" / "step-4"

    def losses(name):
        return [r["loss"] for r in read_jsonl(root / "runs" / name / "metrics.jsonl") if "loss" in r]
    assert losses("bf16-cut") == losses("bf16-full")  # the exact fp32 weights came back
    with safe_open(str(ckpt / MASTER_WEIGHTS), "pt") as a, safe_open(str(cut / MASTER_WEIGHTS), "pt") as b:
        assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())

    _sft(root, bf16_model, "bf16-as-fp32", max_steps=1, save_dtype="fp32")  # asked for: fp32, nothing beside
    ckpt = root / "runs" / "bf16-as-fp32" / "checkpoints" / "step-1"
    assert _weights_dtypes(ckpt) == {torch.float32} and not (ckpt / MASTER_WEIGHTS).exists()


def test_an_fp32_model_is_saved_in_fp32_with_nothing_beside(root):
    _sft(root, root / "model", "fp32", max_steps=1)
    ckpt = root / "runs" / "fp32" / "checkpoints" / "step-1"
    assert _weights_dtypes(ckpt) == {torch.float32} and not (ckpt / MASTER_WEIGHTS).exists()
    assert json.loads((ckpt / "config.json").read_text())["dtype"] == "float32"
