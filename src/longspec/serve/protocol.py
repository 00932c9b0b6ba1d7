"""The OpenAI-compatible request bodies the server accepts, validated by pydantic.

Fields OpenAI defines but this server does not implement are accepted only at their
neutral value (no `suffix`, `best_of` 1) and refused otherwise with a message saying
so; unknown fields are refused. A completion's `prompt` takes OpenAI's four forms (a
string, token ids, a batch of strings, a batch of token-id lists); `echo` returns the
prompt before the completion, with its tokens' log-probabilities when `logprobs` is
given (`max_tokens: 0` scores the prompt alone, as evaluation harnesses ask). Chat content may be a list of text parts, and
the `developer` role is the system role. Extra fields: `top_k`, `min_p`, vLLM's
`ignore_eos` and `structured_outputs` (json, regex, grammar, choice), and the
speculation per request: `method` (a registered method name) and `method_options`
(that drafter's bounded options, `request_options.py`). `response_format` (OpenAI's
JSON mode and JSON schemas) is taken by completions too, as vLLM takes it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationError, field_validator,
                      model_validator)

from longspec.request import SAMPLING_FIELDS
from longspec.speculation.grammar import OutputConstraint
from longspec.speculation.logprobs import MAX_TOP


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | StrictBool = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('give json_schema exactly with type "json_schema"')
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of a JSON schema, a regex, a grammar
    (Lark or GBNF), a choice of strings, or any JSON object."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = Field(default=None, max_length=1024)
    json_object: StrictBool | None = None

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [name for name in ("json_", "regex", "grammar", "choice", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, grammar, choice, json_object")
        return self

    def constraint(self) -> OutputConstraint:
        if self.json_ is not None:
            return OutputConstraint("json_schema", self.json_)
        if self.regex is not None:
            return OutputConstraint("regex", self.regex)
        if self.grammar is not None:
            return OutputConstraint("grammar", self.grammar)
        if self.choice is not None:
            return OutputConstraint("choice", self.choice)
        return OutputConstraint("json_object")


class GenerationFields(BaseModel):
    """What completions and chat completions share."""

    # Strict types: "0.5" is not a number and true is not 1; NaN and infinities are refused.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat = Field(default=1.0, ge=0.0)
    top_p: StrictFloat = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: StrictInt | None = Field(default=None, ge=0, le=2**64 - 1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(default=1, ge=1)
    presence_penalty: StrictFloat | StrictInt = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat | StrictInt = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, StrictFloat | StrictInt] | None = Field(default=None, max_length=1024)
    user: str | None = None
    # longspec's own fields.
    top_k: StrictInt | None = Field(default=None, ge=0, le=2**31 - 1)
    ignore_eos: StrictBool = False  # vLLM's extension: generate past EOS up to max_tokens
    min_p: StrictFloat | None = Field(default=None, ge=0.0, le=1.0)
    typical_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)  # vLLM's and transformers'
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    method: str | None = None
    method_options: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stops_non_empty(cls, stop):
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop strings, got {len(stops)}")
        return stop

    @model_validator(mode="after")
    def _unsupported_values(self):
        refused = {
            "stream_options": (self.stream_options is not None and not self.stream,
                               "stream_options is only allowed with stream: true"),
            "structured_outputs": (self.structured_outputs is not None and self.response_format is not None
                                   and self.response_format.type != "text",
                                   "give response_format or structured_outputs, not both"),
            "ignore_eos": (self.ignore_eos and self.constraint is not None,
                           "ignore_eos cannot go with structured output (a finished grammar allows only EOS)"),
        }
        for field, (bad, message) in refused.items():
            if bad:
                raise ValueError(f"{field}: {message}")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token_id(cls, bias):
        for key, value in (bias or {}).items():
            if not (key.isascii() and key.isdigit()):  # str.isdigit alone takes "٣" and "²"
                raise ValueError(f"keys are token ids (as strings, e.g. \"42\"), got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"biases lie in [-100, 100], got {value} for token {key}")
        return bias

    @property
    def constraint(self) -> OutputConstraint | None:
        """The structured output asked for (not yet compiled), or None."""
        if self.structured_outputs is not None:
            return self.structured_outputs.constraint()
        if self.response_format is None or self.response_format.type == "text":
            return None
        if self.response_format.type == "json_object":
            return OutputConstraint("json_object")
        return OutputConstraint("json_schema", self.response_format.json_schema.schema_)

    def sampling_fields(self) -> dict[str, Any]:
        """The request's sampling settings by `SamplingParams`' names: every field this
        protocol shares with it, as given (so a new sampling option is declared here
        once), with OpenAI's spellings turned into ours."""
        given = {name: getattr(self, name) for name in SAMPLING_FIELDS & set(type(self).model_fields)}
        given["logit_bias"] = self.token_bias  # keys are token ids as strings in JSON
        if given.get("top_p") == 1.0:
            given["top_p"] = None  # OpenAI's default: no nucleus
        return {name: value for name, value in given.items() if value is not None}

    @property
    def token_bias(self) -> dict[int, float]:
        return {int(key): float(value) for key, value in (self.logit_bias or {}).items()}

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def logprob_alternatives(self) -> int | None:
        """How many most likely tokens to report beside each chosen token's
        log-probability (0: its own alone), or None: no log-probabilities."""
        raise NotImplementedError

    @property
    def prompt_count(self) -> int:
        """Prompts in the request (a batch of completion prompts; one otherwise)."""
        return 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


_Text = Annotated[str, Field(min_length=1)]
_TokenIds = Annotated[list[StrictInt], Field(min_length=1)]
Prompt = _Text | _TokenIds | Annotated[list[_Text], Field(min_length=1)] | Annotated[list[_TokenIds], Field(min_length=1)]
PROMPT_FORMS = "a string, a list of token ids, a list of strings, or a list of token-id lists"


class CompletionRequest(GenerationFields):
    # OpenAI's four forms; a list of strings or of token-id lists is a batch: one choice per prompt (times n).
    prompt: Prompt
    max_tokens: StrictInt | None = Field(default=16, ge=0)  # OpenAI's default; 0 only with echo
    # The log-probabilities of the chosen tokens and of the `logprobs` most likely at each position.
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_TOP)
    echo: StrictBool = False  # the prompt before the completion (and its log-probabilities, with logprobs)
    best_of: Literal[1] | None = None
    suffix: None = None

    @property
    def logprob_alternatives(self) -> int | None:
        return self.logprobs

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch: each prompt as text or token ids."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)

    @property
    def prompt_count(self) -> int:
        return len(self.prompts)

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_of_the_prompt_forms(cls, prompt, handler):
        if isinstance(prompt, (str, list)) and not prompt:
            raise ValueError("the prompt is empty")
        if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
            empty = next((i for i, item in enumerate(prompt) if isinstance(item, (str, list)) and not item), None)
            if empty is not None:
                raise ValueError(f"prompt {empty} of the batch is empty")
        try:
            return handler(prompt)
        except ValidationError:  # the union's own message lists every branch's error ("prompt.str: ...")
            raise ValueError(f"the prompt must be {PROMPT_FORMS}") from None

    @model_validator(mode="after")
    def _nothing_to_return(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 generates nothing; it is allowed with echo: true (to score the prompt)")
        return self


class TextPart(BaseModel):
    """A text part of a message's content (OpenAI's `{"type": "text", "text": ...}`);
    other part types (images, audio, files) are refused by their type."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # "developer" is OpenAI's newer name for the system role: mapped to "system" (`text`).
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _only_text_parts(cls, content):
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"content parts of type {kind!r} are not supported: this server reads text parts "
                                     "only ({'type': 'text', 'text': ...})")
        return content

    def for_template(self) -> dict:
        """The message as a chat template reads it: one string, the developer role as system."""
        text = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_TOP)

    @model_validator(mode="after")
    def _coherent_fields(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self

    @property
    def logprob_alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
