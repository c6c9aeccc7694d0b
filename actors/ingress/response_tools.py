"""Function calling on OpenAI's Responses API, in terms of the client API's tools (no I/O).

The Responses API writes a function flat (`{"type": "function", "name", "description",
"parameters", "strict"}`) where chat completions nest it under "function", and a named
`tool_choice` as `{"type": "function", "name"}`; a reply's calls are output items of their own
(`function_call`, with the `call_id` a result answers), and a result comes back as an input
item (`function_call_output`). Here each becomes the client API's shape and back: the tools and
the choice go to the chat request, calls and results are chat messages (an assistant's
`tool_calls`, a tool's message), so a conversation's token log holds them like any other turn.
"""

from __future__ import annotations

from typing import Any

from pensieve.actors.ingress.openai_errors import invalid

Message = dict[str, Any]
_CHOICES = ("auto", "none", "required")
_FUNCTION_FIELDS = ("name", "description", "parameters", "strict")


def chat_tools(body: dict[str, Any]) -> dict[str, Any]:
    """A request's `tools` and `tool_choice` as the chat request's (nothing if it gives no
    tools and no choice that needs them)."""
    given = body.get("tools") or []
    if not isinstance(given, list):
        raise invalid("'tools' must be an array of function tools", "tools")
    tools = [_chat_tool(tool, i) for i, tool in enumerate(given)]
    choice = body.get("tool_choice")
    asked: dict[str, Any] = {"tools": tools} if tools else {}
    if isinstance(choice, dict) and choice.get("type") == "function":
        asked["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice == "required" or (tools and choice in _CHOICES):
        asked["tool_choice"] = choice
    elif choice not in (None, "auto", "none"):
        raise invalid(
            "'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', 'name'}",
            "tool_choice",
        )
    return asked


def _chat_tool(tool: object, i: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise invalid(
            f"tools[{i}] must be {{'type': 'function', 'name', 'parameters', ...}}: no other "
            "type of tool is supported",
            "tools",
        )
    unknown = set(tool) - {"type", *_FUNCTION_FIELDS}
    if unknown:
        raise invalid(f"tools[{i}] has unknown field(s): {', '.join(sorted(unknown))}", "tools")
    function = {name: tool[name] for name in _FUNCTION_FIELDS if tool.get(name) is not None}
    return {"type": "function", "function": function}


def response_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat request's tools as a response shows them."""
    shown = []
    for tool in tools:
        function = tool["function"]
        shown.append(
            {
                "type": "function",
                "name": function["name"],
                "description": function.get("description"),
                "parameters": function.get("parameters"),
                "strict": function.get("strict", True),
            }
        )
    return shown


def response_choice(choice: str | dict[str, Any] | None, tools: list[Any]) -> Any:
    """The chat request's `tool_choice` as a response shows it."""
    if isinstance(choice, dict):
        return {"type": "function", "name": choice["function"]["name"]}
    return choice or ("auto" if tools else "none")


def input_item(item: dict[str, Any], where: str, chat: list[Message]) -> bool:
    """Add a `function_call` or `function_call_output` input item to `chat`, as a call of the
    assistant's message before it (a new one if there is none) or a tool's message; False if
    it is neither."""
    kind = item.get("type")
    if kind == "function_call_output":
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(call_id, str):
            raise invalid(f"{where}.call_id must be a string", where.split("[")[0])
        chat.append({"role": "tool", "tool_call_id": call_id, "content": _output(output, where)})
        return True
    if kind != "function_call":
        return False
    fields = [item.get(name) for name in ("call_id", "name", "arguments")]
    if not all(isinstance(field, str) for field in fields):
        raise invalid(
            f"{where} must have 'call_id', 'name' and 'arguments' strings", where.split("[")[0]
        )
    call_id, name, arguments = fields
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    if not chat or chat[-1]["role"] != "assistant":
        chat.append({"role": "assistant", "content": ""})
    chat[-1]["tool_calls"] = [*chat[-1].get("tool_calls", ()), call]
    return True


def _output(output: object, where: str) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(
        isinstance(part, dict) and isinstance(part.get("text"), str) for part in output
    ):
        return "".join(part["text"] for part in output)
    raise invalid(f"{where}.output must be a string or an array of text parts", "input")


def call_item(turn: int, conv_id: str, index: int, call: dict[str, Any], status: str) -> Message:
    """Call `index` of a reply as a `function_call` output item (its arguments empty while in
    progress)."""
    function = call["function"]
    return {
        "type": "function_call",
        "id": f"fc_{turn}_{index}_{conv_id}",
        "call_id": call["id"],
        "name": function["name"],
        "arguments": "" if status == "in_progress" else function["arguments"],
        "status": status,
    }


def sent_alone(items: list[Message]) -> dict[str, Any] | None:
    """The chat request fields that add `items` to a conversation whose last reply they
    follow, when they are tool results and then at most one user message (None: they are
    not)."""
    results = [m for m in items if m["role"] == "tool"]
    rest = items[len(results) :]
    if items[: len(results)] != results or len(rest) > 1 or not items:
        return None
    if rest and rest[0]["role"] != "user":
        return None
    fields: dict[str, Any] = {}
    if results:
        fields["tool_results"] = [
            {"tool_call_id": m["tool_call_id"], "content": m["content"]} for m in results
        ]
    if rest:
        fields["message"] = rest[0]["content"]
    return fields
