"""`tether chat model=<checkpoint | run directory | hub id>`: talk to a model in the terminal.

    tether chat model=runs/my-grpo                          # a run: its latest checkpoint, the final model
    tether chat model=runs/my-sft/checkpoints/step-200 temperature=0 system="Answer in one line."
    tether chat model=runs/calc-grpo env=calculator         # the environment's tools, run as in its episodes

Replies come from tether's own sampler (tether.rollout, the one training and `tether eval` sample
with) and are written out as they are drawn (`Sampler.sample(stream=...)`). The conversation is
kept as token ids, never re-tokenized, as an environment's episodes keep theirs
(tether.envs.render): the first message is the chat template's render through the generation
prompt (`prompt_ids`); the model's ids follow as sampled; every later message — yours, or the
environment's tool results — is the template's delta after them (`observation_ids`). A message the
model did not end with the template's end of turn (cut at max_new_tokens, or by Ctrl-C) is closed
with it. A model without a chat template (or plain=true) continues plain text: each line you type
is appended on a line of its own and the model goes on from it.

With env=, the environment's tools are offered as in its episodes (the chat template's `tools=`, or
a system message for a template that does not print them) and the tool calls the model writes are
run by the same `Episode` the rollouts run (tether.envs.rollouts.EpisodeBatch.turn_ended; a code
tool's code stays in the sandbox); their results are appended and the model goes on, up to
max_turns messages in answer to one of yours. Each conversation resets the environment with
your first message as the row's prompt (other columns from its own rows(1, seed), when it has them),
so it frames the message as its episodes do (calculator adds its instructions).

In the chat: /reset starts a new conversation (the system prompt stays), /system <text> sets the
system prompt and starts a new one, /exit or end of input (Ctrl-D) ends. Ctrl-C while the model
writes stops the message there.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

from tether.config import ConfigError
from tether.constraints import NonNegative, NonNegativeInt, Positive, PositiveInt, Range, Seed
from tether.data.chat import ChatTemplateError, encode_text
from tether.data.tokenize import bos_ids
from tether.envs.episode import Episode, env_rows, load_env
from tether.envs.render import end_of_turn_ids, observation_ids, prompt_ids
from tether.envs.rollouts import EpisodeBatch
from tether.errors import UserError
from tether.rollout import Sampler, SamplingConfig
from tether.rollout.native import unwrap
from tether.run import latest_checkpoint

COMMANDS_HELP = "/reset (new conversation), /system <text> (system prompt, new conversation), /exit"


@dataclass
class ChatConfig:
    model: str = ""
    "the model: a checkpoint directory, a run directory (its latest checkpoint: a finished run's final model), a hub id or a .gguf file"
    system: str = ""
    "system prompt of every conversation (/system <text> changes it); plain completion: the text starts with it"
    temperature: NonNegative = 0.7
    "sampling temperature; 0 = greedy"
    top_p: Annotated[float, Range(gt=0, le=1)] = 1.0
    "nucleus sampling: draw from the smallest set of likeliest tokens holding this probability (1 = off)"
    top_k: NonNegativeInt = 0
    "draw from the k likeliest tokens only (0 = off)"
    max_new_tokens: PositiveInt = 512
    "most tokens of one model message (a message cut there is kept as cut, and closed)"
    seed: Seed = 0
    "sampling seed: the same messages in the same order get the same replies"
    plain: bool = False
    "plain completion even when the tokenizer has a chat template (a base model): each line is appended to the text and the model continues it"
    env: str = ""
    "an environment whose tools the model may call: a built-in (calculator, python, wordle) or 'module:Class' / './file.py:Class' (docs/environments.md)"
    tool_format: str = "auto"
    "how the model writes tool calls: auto (from the chat template), hermes, gemma or plain"
    tool_timeout_s: Positive = 10.0
    "each tool call's deadline; past it the model reads an error"
    max_tool_calls: NonNegativeInt = 8
    "tool calls run per model message; further ones are answered with an error"
    max_turns: PositiveInt = 8
    "most model messages in answer to one of yours (each but the last calling tools), as an episode's max_turns"
    save: str = ""
    "a JSON file the conversation is written to after every reply: its messages, and its token ids exactly as the model read and wrote them"
    dtype: str = "auto"
    "weight dtype: auto (bf16 on a GPU that has it, else fp32) | fp32 | bf16 | fp16"
    device: str = "auto"
    "cuda | cpu | auto"

    def __post_init__(self):
        if not self.model:
            raise ConfigError("config key 'model' is required: model=<checkpoint, run directory or hub id>")


class ContextFull(UserError):
    """The conversation fills the model's context: nothing more can be read or written."""


def resolve_model_path(path: str) -> str:
    """A model path as given (a model or checkpoint directory, a hub id, a .gguf file) or, for a
    run directory, its latest checkpoint: a finished run's final model."""
    p = Path(path).expanduser()
    if not p.is_dir() or (p / "config.json").exists() or (p / "adapter_config.json").exists():
        return path
    ckpt = latest_checkpoint(p)
    if ckpt is None:
        raise UserError(f"model '{path}' is a directory with neither a model (config.json) nor "
                        "checkpoints (checkpoints/step-N): give a checkpoint, a run directory or a hub id")
    return str(ckpt)


def _template(tokenizer, cfg: ChatConfig, factory) -> tuple[bool, Any]:
    """(plain completion?, the template's end of turn or None); refused in one line when the
    configuration cannot work with this tokenizer."""
    plain = cfg.plain or not getattr(tokenizer, "chat_template", None)
    if plain:
        if factory is not None:
            raise UserError(f"env={cfg.env} needs a chat template to offer its tools and read their "
                            f"results; {'plain=true was given' if cfg.plain else 'the tokenizer has none'}")
        return True, None
    try:
        return False, end_of_turn_ids(tokenizer)
    except ChatTemplateError as e:
        raise UserError(f"the chat template cannot be continued turn by turn: {e}; plain=true "
                        "continues plain text instead") from None


def new_episode(factory: Callable[[], Any], tokenizer, cfg: ChatConfig) -> Episode:
    """An episode of the environment for one conversation (not started: the first message starts it)."""
    ep = Episode(factory(), tokenizer, tool_format=cfg.tool_format, tool_timeout_s=cfg.tool_timeout_s,
                 max_tool_calls=cfg.max_tool_calls)
    if ep.step_based:
        raise UserError(f"env={cfg.env}: {ep.name} is step-based (it answers every message itself); "
                        "chat runs the tools of a class-based environment")
    return ep


def decode(tokenizer, ids: list[int]) -> str:
    """Text of ids as written out: special tokens left out, no clean-up of spaces (so the text of a
    prefix of the ids is a prefix of the text, and a message can be written out as it grows)."""
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


class _Shown:
    """A model message written to `out` as its ids arrive: the decoded text past what is already
    written (a text ending in an incomplete character waits for the next ids)."""

    def __init__(self, tokenizer, out, stop: list[int]):
        self.tok, self.out, self.stop = tokenizer, out, stop
        self.ids: list[int] = []
        self.written = 0

    def add(self, ids: list[int]) -> None:
        self.ids += ids
        text = self.text()
        if not text.endswith("\ufffd"):
            self._write(text)

    def text(self) -> str:
        k = len(self.stop)
        return decode(self.tok, self.ids[:-k] if k and self.ids[-k:] == self.stop else self.ids)

    def _write(self, text: str) -> None:
        if len(text) > self.written:
            self.out.write(text[self.written:])
            self.out.flush()
            self.written = len(text)

    def close(self) -> None:
        self._write(self.text())
        self.out.write("\n")
        self.out.flush()


class Chat:
    """One conversation with a model at a time. `ids` is every token id the model has read or
    written, in order: the prompt's render, the model's ids as sampled, the template's deltas of
    the user's messages and of the environment's tool results. `messages` is the same
    conversation as text (what the template would render; `ids` is what the model saw)."""

    def __init__(self, model, tokenizer, cfg: ChatConfig, factory: Optional[Callable[[], Any]] = None,
                 out=None, note=None):
        self.tok, self.cfg, self.factory = tokenizer, cfg, factory
        self.out = out if out is not None else sys.stdout
        self.note = note if note is not None else (lambda text: print(text, file=sys.stderr, flush=True))
        self.plain, self.eot = _template(tokenizer, cfg, factory)
        self.stop = [] if self.plain else self.eot.stop
        self.sampler = Sampler(model, tokenizer, SamplingConfig(
            max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
            top_k=cfg.top_k, sync_every=1, stop_token_ids=self.stop[-1:]))
        self.context = getattr(unwrap(model).config, "max_position_embeddings", None)
        self.system = cfg.system
        self.replies = 0        # sampled messages so far: each one's seed is cfg.seed + this
        self.conversations = 0  # started so far: the environment's row of each is drawn with this seed
        self.reset()

    # -- the conversation --------------------------------------------------------------------------

    def reset(self) -> None:
        """A new conversation (the system prompt stays)."""
        self.ids: list[int] = []
        self.messages: list[dict] = []
        self.episode = None if self.factory is None else new_episode(self.factory, self.tok, self.cfg)
        self.tools = self.episode.tools if self.episode is not None else None

    def user(self, text: str) -> list[int]:
        """Add the user's message; returns the ids it added: the template's render of the first
        message (with the system prompt; with an environment, as its reset frames it), or the
        template's delta after the model's last ids; plain completion: the text itself."""
        msg = {"role": "user", "content": text}
        if self.plain:
            messages = [msg]
            if not self.ids:
                start = f"{self.system}\n{text}" if self.system else text
                ids = bos_ids(self.tok) + encode_text(self.tok, start)
            else:
                ids = encode_text(self.tok, text if decode(self.tok, self.ids[-1:]).endswith("\n") else "\n" + text)
        elif not self.ids:
            messages = self._first(msg)
            ids = prompt_ids(self.tok, messages, self.tools)
        else:
            messages = [msg]
            ids = observation_ids(self.tok, messages, self.tools)
        if self.context and len(self.ids) + len(ids) >= self.context:
            raise ContextFull(f"the conversation would be {len(self.ids) + len(ids)} tokens, the model "
                              f"reads at most {self.context}: /reset starts a new one")
        if self.episode is not None and self.ids:
            self.episode.continue_with(messages)
        self.messages += messages
        self.ids += ids
        return ids

    def _first(self, msg: dict) -> list[dict]:
        if self.episode is None:
            return ([{"role": "system", "content": self.system}] if self.system else []) + [msg]
        try:  # the environment's own columns for its reset, when it draws rows itself
            row = env_rows(self.factory, 1, seed=self.cfg.seed + self.conversations)[0]
        except UserError:
            row = {}
        self.conversations += 1
        return self.episode.start({**row, "prompt": msg["content"]}, system=self.system or None)

    def reply(self) -> list[dict]:
        """The model's answer to the conversation so far, each message written to `out` as it is
        sampled; with an environment, its tool calls run and their results (written out as
        `[tool] ...` lines) appended until a message calls none, or max_turns. Returns the
        messages added."""
        batch = None if self.episode is None else EpisodeBatch([self.episode], self.tok, self.cfg.max_turns)
        added: list[dict] = []
        while True:
            calls = batch.tool_calls[0] if batch is not None else 0
            try:
                ids = self.sample()
            except ContextFull as e:
                self.note(f"({e})")
                return added
            n = len(self.messages)
            results = self.take(ids, batch)
            added += self.messages[n:]
            if results is None:
                if batch is not None and batch.tool_calls[0] > calls:  # tools ran; the model reads no results
                    why = {"turns": f"max_turns={self.cfg.max_turns} reached",
                           "done": "the environment is done"}.get(batch.reasons[0], batch.reasons[0])
                    self.note(f"({why}: the last tool results are not shown to the model)")
                return added
            for m in results:
                self.out.write(f"[tool] {m.get('content', '')}\n")
            self.out.flush()

    def sample(self) -> list[int]:
        """One model message's ids as sampled, its text written out as the ids are drawn. Ctrl-C
        stops it: the ids drawn until then are the message."""
        room = self.cfg.max_new_tokens
        if self.context:
            room = min(room, self.context - len(self.ids))
            if room < 1:
                raise ContextFull(f"the conversation fills the model's context ({self.context} tokens): "
                                  "/reset starts a new one")
        shown = _Shown(self.tok, self.out, self.stop)
        seed = self.cfg.seed + self.replies
        self.replies += 1
        try:
            ro = self.sampler.sample([self.ids], seed=seed, stream=lambda _, ids: shown.add(ids),
                                     max_new_tokens=room)
            ids = ro.completion_lists()[0]
        except KeyboardInterrupt:
            self.sampler.release()  # cut anywhere in a decode: the next call starts from scratch
            ids = list(shown.ids)
        shown.close()
        return ids

    def take(self, ids: list[int], batch: Optional[EpisodeBatch] = None) -> Optional[list[dict]]:
        """Put a model message's sampled `ids` into the conversation as they are. With an
        environment (`batch`), the episode reads the message and runs its tool calls
        (`EpisodeBatch.turn_ended`, as in the rollouts): the results' ids are appended and their
        messages returned — the model reads them next. Else None: the floor is the user's, and a
        message that does not end with the template's end of turn gets it appended. Plain
        completion keeps the ids but a final end-of-text token, so the text goes on."""
        if self.plain:
            self.ids += ids[:-1] if ids and ids[-1] in self.sampler.eos else ids
            self.messages.append({"role": "assistant", "content": decode(self.tok, ids)})
            return None
        self.ids += ids
        k = len(self.stop)
        text = decode(self.tok, ids[:-k] if ids[-k:] == self.stop else ids)
        self.messages.append({"role": "assistant", "content": text})
        results = None
        if batch is not None:
            before = len(self.episode.messages)
            reply = batch.turn_ended(0, ids)
            if reply is not None:
                results = self.episode.messages[before + 1:]  # after the assistant's message
                self.ids += reply
                self.messages += results
        if results is None and ids[-k:] != self.stop:
            self.ids += self.stop
        return results

    def save(self, path: str) -> None:
        """The conversation as JSON: its messages and its token ids."""
        p = Path(path).expanduser()
        p.parent.mkdir(parents=True, exist_ok=True)
        data = {"model": self.cfg.model, "template": "plain" if self.plain else "chat",
                "system": self.system, "env": self.cfg.env or None, "tools": self.tools or [],
                "messages": self.messages, "ids": self.ids}
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps(data, ensure_ascii=False) + "\n", encoding="utf-8")
        tmp.replace(p)


# -- the command ----------------------------------------------------------------------------------

def _lines(interactive: bool):
    """The user's lines: from the terminal with a prompt (and line editing), else read from stdin."""
    if interactive:
        try:
            import readline  # noqa: F401 - input() gets line editing and history
        except ImportError:
            pass
    while True:
        try:
            line = input("> ") if interactive else sys.stdin.readline()
        except (EOFError, KeyboardInterrupt):
            if interactive:
                print()
            return
        if not interactive and not line:
            return
        yield line.rstrip("\r\n")


def run_chat(cfg: ChatConfig) -> dict:
    """Chat on stdin / stdout until /exit or the end of input; returns how many messages were
    sampled."""
    from tether.models.load import hf_progress, load_model, load_tokenizer

    path = resolve_model_path(cfg.model)
    factory = load_env(cfg.env) if cfg.env else None
    tokenizer = load_tokenizer(path)
    _template(tokenizer, cfg, factory)  # what cannot work is said before the model loads
    if factory is not None:
        new_episode(factory, tokenizer, cfg)
    with hf_progress(False):
        model = load_model(path, dtype=cfg.dtype, device=cfg.device)
    chat = Chat(model, tokenizer, cfg, factory)
    device = next(model.parameters()).device
    how = "plain completion" if chat.plain else "chat template"
    if chat.episode is not None:
        names = [t["function"]["name"] for t in chat.episode.tool_schemas]
        how += f", {cfg.env}'s tools: {', '.join(names) or 'none'}"
    chat.note(f"tether chat: {path} on {device.type} ({how}). {COMMANDS_HELP}")
    for line in _lines(sys.stdin.isatty()):
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            command, _, rest = text.partition(" ")
            if command in ("/exit", "/quit"):
                break
            if command == "/reset":
                chat.reset()
                chat.note("(new conversation)")
            elif command == "/system":
                chat.system = rest.strip()
                chat.reset()
                chat.note(f"(system prompt {'set' if chat.system else 'cleared'}; new conversation)")
            else:
                chat.note(f"(unknown command {command}: {COMMANDS_HELP})")
            continue
        first = not chat.ids
        try:
            chat.user(line)
        except ContextFull as e:
            chat.note(f"({e})")
            continue
        if first and chat.episode is not None and chat.messages[-1]["content"] != line:
            chat.note(f"({cfg.env} frames your message as: {chat.messages[-1]['content']!r})")
        chat.reply()
        if cfg.save:
            chat.save(cfg.save)
    return {"replies": chat.replies}


__all__ = ["ChatConfig", "Chat", "run_chat", "resolve_model_path", "ContextFull"]
