"""Environments for multi-turn, tool-using RL (docs/environments.md).

An environment is a class in one of two shapes -- class-based with tools (TRL's
`environment_factory`) or step-based (SkyRL / OpenEnv) -- and :class:`Episode` drives either the
same way for the episode loop: `start(row)`, `tools`, `respond(text) -> Turn`, `final_reward()`.
`observation_ids` / `end_of_turn_ids` / `prompt_ids` turn an episode's messages into token ids
that extend the sampled sequence without re-tokenizing it.

Layer: above rewards (the sandbox, the spec loader), tasks and data (chat templates).
"""

from tether.envs.episode import (DEFAULT_TOOL_TIMEOUT_S, Episode, EnvError, EnvResetError, Turn,
                                 builtin_envs, env_rows, load_env)
from tether.envs.formats import (FORMATS, ToolCall, ToolFormat, ToolResult, detect_tool_format,
                                 get_tool_format)
from tether.envs.render import (EndOfTurn, ObservationTemplateError, end_of_turn_ids,
                                observation_ids, prompt_ids, template_renders_tools)
from tether.envs.tools import RESERVED, Tool, find_tools

__all__ = ["Episode", "Turn", "EnvError", "EnvResetError", "DEFAULT_TOOL_TIMEOUT_S", "load_env",
           "builtin_envs", "env_rows", "ToolCall", "ToolResult", "ToolFormat", "FORMATS",
           "detect_tool_format", "get_tool_format", "EndOfTurn", "ObservationTemplateError",
           "end_of_turn_ids", "observation_ids", "prompt_ids", "template_renders_tools", "RESERVED",
           "Tool", "find_tools"]
