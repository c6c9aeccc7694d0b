"""What the tool-calling tests share: a chat template that shows tools to SmolLM2 (its own
ignores them), in the Hermes style of Qwen 2.5's (ChatML, calls in <tool_call> blocks, results
in <tool_response> blocks), and two tools of a weather-style round trip."""

from __future__ import annotations

from pathlib import Path
from typing import Any

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
TOOLS_TEMPLATE = (
    """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}
    {%- else %}{{- '"""
    + SYSTEM
    + """' }}{%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query."
        "\\n\\nYou are provided with function signatures within <tools></tools> XML tags:"
        "\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and"
        " arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": "
        "<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\n"""
    + SYSTEM
    + """<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first)
          or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for call in message.tool_calls %}
            {{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' }}
            {{- call.function.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""
)

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city's name"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
]
QUESTION = "What is the weather like in Paris today?"
WEATHER = {"type": "function", "function": {"name": "get_weather"}}  # tool_choice
RESULT = '{"city": "Paris", "temperature_c": 21, "sky": "sunny"}'


def write_template(folder: Path) -> Path:
    path = folder / "tools.jinja"
    path.write_text(TOOLS_TEMPLATE)
    return path
