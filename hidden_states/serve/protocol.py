"""The wire protocol of ``hidden-states serve``: the part of vLLM's OpenAI API that speculators 0.9 talks to.

speculators 0.9.0's client (``data_generation/vllm_client.py``; ``generate-offline-data --endpoint
URL/v1``, the trainer's ``--on-missing generate --vllm-endpoint URL/v1``) makes two calls:

* ``GET /v1/models``: it uses the first id, and the trainer refuses one that is not its
  ``--verifier-name-or-path``;
* ``POST /v1/completions`` with ``model``, ``prompt`` (token ids), ``max_tokens: 1`` and
  ``return_token_ids: true``: the reply's ``choices[0].prompt_token_ids`` must equal the ids sent,
  and its top-level ``kv_transfer_params.hidden_states_path`` names the states' file
  (``serve.state_files``).

A request that cannot be served gets an OpenAI-style error (``{"error": {"message": ...}}``, which
the client prints): 400 for a malformed one, 404 for another model's, 401 without the server's key
(:func:`carries_key`). Pure functions of the request's parts: the HTTP server (``serve.http_server``)
reads the bytes and sends the replies.
"""
from __future__ import annotations

import base64
import hmac
import re
import time
import uuid
from http import HTTPStatus

MAX_BODY = 64 * 1024 * 1024  # bytes of one request's JSON: far above any row's token ids
MAX_DEPTH = 16  # JSON nesting a body may have: a completion's is 3 ({"prompt": [[ids]]})
# that many openers in a row, blanks between: refused before the parser meets them
TOO_DEEP = re.compile(rb"[\[{](?:\s*[\[{]){%d}" % MAX_DEPTH)


class BadRequest(Exception):
    """A request the server cannot serve: its HTTP status and the message the client shows."""

    def __init__(self, status: HTTPStatus, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


def completion_ids(body: dict, model_id: str, vocab_size: int, max_seq_len: int) -> list[int]:
    """The token ids of a ``/v1/completions`` request, or :class:`BadRequest` saying what is wrong."""
    model = body.get("model")
    if model != model_id:
        raise BadRequest(HTTPStatus.NOT_FOUND, f"The model `{model}` does not exist: this server serves "
                                               f"`{model_id}` (GET /v1/models)", "model")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]  # OpenAI's batch of prompts, of one
    if not isinstance(prompt, list) or not prompt or not all(type(i) is int for i in prompt):
        raise BadRequest(HTTPStatus.BAD_REQUEST, "prompt must be a non-empty list of token ids: this server "
                                                 "returns hidden states for token ids and tokenizes no text",
                         "prompt")
    outside = [i for i in prompt if not 0 <= i < vocab_size]
    if outside:
        raise BadRequest(HTTPStatus.BAD_REQUEST, f"prompt: token ids {outside[:5]} outside the model's vocabulary "
                                                 f"[0, {vocab_size})", "prompt")
    if len(prompt) > max_seq_len:
        raise BadRequest(HTTPStatus.BAD_REQUEST, f"prompt: {len(prompt)} tokens, more than the server's "
                                                 f"--max-seq-len {max_seq_len}", "prompt")
    if body.get("max_tokens", 1) != 1:
        raise BadRequest(HTTPStatus.BAD_REQUEST, f"max_tokens {body.get('max_tokens')!r}: must be 1 (the reply "
                                                 f"carries the prompt's hidden states; nothing is generated)",
                         "max_tokens")
    if body.get("stream"):
        raise BadRequest(HTTPStatus.BAD_REQUEST, "stream: not served (one reply per request)", "stream")
    return prompt


def completion_reply(ids: list[int], path: str, model_id: str) -> dict:
    """What vLLM's ``/v1/completions`` answers with ``return_token_ids`` and a hidden-states connector."""
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model_id,
            "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None,
                         "prompt_token_ids": ids, "token_ids": []}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)},
            "kv_transfer_params": {"hidden_states_path": path}}


def models_reply(model_id: str, max_seq_len: int, created: int) -> dict:
    return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                        "owned_by": "hidden-states", "root": model_id,
                                        "max_model_len": max_seq_len}]}


ERROR_TYPES = {HTTPStatus.NOT_FOUND: "NotFoundError", HTTPStatus.UNAUTHORIZED: "AuthenticationError"}


def error_reply(status: HTTPStatus, message: str, param: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status) or ("BadRequestError" if status < 500 else "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": int(status)}}


def carries_key(authorization: str | None, api_key: str) -> bool:
    """Whether an ``Authorization`` header carries ``api_key``: ``Bearer KEY`` (vLLM's, the OpenAI
    clients'), or ``Basic`` with KEY as the password, any user name (a URL ``http://any:KEY@host/v1``:
    what speculators 0.9's client, which sends the key ``EMPTY`` of its own, can be given). Compared in
    constant time."""
    scheme, _, value = (authorization or "").strip().partition(" ")
    value = value.strip()
    if scheme.lower() == "basic":
        try:
            value = base64.b64decode(value, validate=True).decode().partition(":")[2]
        except (ValueError, UnicodeDecodeError):
            return False
    elif scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(value.encode(), api_key.encode())
