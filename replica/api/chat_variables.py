"""What a chat request gives its chat template beside its messages, as vLLM gives it.

vLLM renders a conversation with more than its messages: the request's ``tools`` (each
as its pydantic model dumps it), ``documents``, ``reasoning_effort`` and the client's
``chat_template_kwargs`` (Qwen's ``enable_thinking``, say), merged in an order of its
own. A gateway that rendered the messages alone would compute other token ids than the
engine for every such request, so other block keys, and route it blind. These functions
give a template what vLLM's OpenAI server (0.32) gives it: :func:`chat_variables` for
``/v1/chat/completions``, :func:`tokenize_variables` for ``/tokenize``, which takes the
tools and ``chat_template_kwargs`` only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel

#: Values vLLM's merge of template arguments drops as unset (its ``merge_kwargs``).
UNSET = (None, "auto")
#: ``apply_chat_template``'s own parameters: the request's fields or transformers take
#: them, so a template never sees them among its variables, whatever a client sends.
PARAMETERS = frozenset(
    {
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "conversation",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class ToolFunction(BaseModel):
    """vLLM's ``FunctionDefinition``: its fields in its order (the order ``tojson`` writes);
    others a client sends are dropped, as vLLM drops them."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class Tool(BaseModel):
    """vLLM's ``ChatCompletionToolsParam``."""

    type: Literal["function"] = "function"
    function: ToolFunction
    defer_loading: bool | None = None

    def as_vllm_dumps_it(self) -> dict[str, Any]:
        """The tool as vLLM's ``model_dump`` gives it to the template: ``description`` and
        ``parameters`` even when null, ``strict`` and ``defer_loading`` only when set (the
        tool's ``defer_loading`` is its function's too, unless that has its own)."""
        f = self.function
        defer = f.defer_loading if f.defer_loading is not None else self.defer_loading
        function = {"name": f.name, "description": f.description, "parameters": f.parameters}
        function |= _set(strict=f.strict, defer_loading=defer)
        return {"type": self.type, "function": function} | _set(defer_loading=self.defer_loading)


class TemplateFields(BaseModel):
    """The fields of a chat request that vLLM gives its template, typed as vLLM types them
    (a value it would refuse raises here: ``pydantic.ValidationError``, a ``ValueError``)."""

    tools: list[Tool] | None = None
    documents: list[dict[str, str]] | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


#: The request's fields a template may be given.
FIELDS = frozenset(TemplateFields.model_fields)


def chat_variables(body: Mapping[str, Any]) -> dict[str, Any]:
    """The variables vLLM's ``/v1/chat/completions`` gives the template of ``body``'s
    conversation beside its messages (empty for a request with none of them). A
    ``reasoning_effort`` sets ``enable_thinking`` too (off for ``"none"``), unless the
    client's ``chat_template_kwargs`` name it."""
    if not FIELDS.intersection(body):  # most chats: no validation on the request path
        return {}
    fields = TemplateFields.model_validate(body)
    kwargs = fields.chat_template_kwargs or {}
    extras: dict[str, Any] = {
        "documents": fields.documents,
        "reasoning_effort": fields.reasoning_effort,
    }
    if fields.reasoning_effort is not None and "enable_thinking" not in kwargs:
        extras["enable_thinking"] = fields.reasoning_effort != "none"
    return merged(fields.tools, kwargs, extras)


def tokenize_variables(body: Mapping[str, Any]) -> dict[str, Any]:
    """The variables vLLM's ``/tokenize`` gives the template of ``body``'s conversation:
    its tools and ``chat_template_kwargs`` (it has no ``documents`` field)."""
    fields = TemplateFields.model_validate(
        {key: body.get(key) for key in ("tools", "chat_template_kwargs")}
    )
    return merged(fields.tools, fields.chat_template_kwargs or {}, {})


def merged(
    tools: list[Tool] | None, kwargs: Mapping[str, Any], extras: Mapping[str, Any]
) -> dict[str, Any]:
    """vLLM's order: the tools, then the client's ``chat_template_kwargs``, then the
    request's own fields, each layer's unset values dropped."""
    variables = {} if tools is None else {"tools": [tool.as_vllm_dumps_it() for tool in tools]}
    for layer in (kwargs, extras):
        variables |= {key: value for key, value in layer.items() if value not in UNSET}
    return {key: value for key, value in variables.items() if key not in PARAMETERS}


def _set(**values: Any) -> dict[str, Any]:
    return {key: value for key, value in values.items() if value is not None}
