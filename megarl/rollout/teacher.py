"""The teacher of on-policy distillation (algorithm.advantage_estimator: opd): an SGLang engine serving another model
with the policy's tokenizer, asked for the log-probs of the tokens the student sampled (prefill only, no generation).

The trainer starts one teacher server itself (teacher.model, through the same engine_server_config / SGLangServer path
as the policy's engines) or uses running ones (teacher.urls). It never receives weight syncs: only the policy's
engines are resharded into.
"""
from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass

import numpy as np

from ..errors import UserError
from .client import EngineClient
from .router import EngineRouter

logger = logging.getLogger(__name__)

# Texts whose encodings must agree between the policy's and the teacher's tokenizers (plain text, digits, code,
# whitespace runs, non-ASCII and the chat markers the tiny and Qwen-style templates use).
_PROBE_TEXTS = ("The quick brown fox jumps over the lazy dog.", "12+30=42, 7*6 = 42?", "def f(x):\n    return x ** 2",
                "  two  spaces\tand a tab\n\n", "naïve café — 東京 🙂", "<|im_start|>user\nhi<|im_end|>\n")


class TeacherTokenizerMismatch(UserError, ValueError):
    """The teacher's tokenizer is not the policy's: its log-probs would score other tokens than the sampled ones."""


def tokenizer_fingerprint(path: str) -> str:
    """A hash of what decides token ids: the vocabulary (with added tokens), the special tokens and the encodings of a
    few probe texts. Two models with equal fingerprints turn the same token ids into the same text and back."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    h = hashlib.sha256()
    h.update(repr(sorted(tok.get_vocab().items())).encode())
    h.update(repr((tok.eos_token_id, tok.pad_token_id, tok.bos_token_id, sorted(tok.all_special_tokens))).encode())
    for text in _PROBE_TEXTS:
        h.update(repr(tok.encode(text, add_special_tokens=False)).encode())
    return h.hexdigest()


def check_same_tokenizer(policy_path: str, teacher_path: str, field: str = "teacher.model") -> None:
    """Refuse a teacher whose tokenizer differs from the policy's (one line naming the field and the fix)."""
    if not os.path.isdir(teacher_path):
        raise TeacherTokenizerMismatch(f"{field}={teacher_path!r} is not a local folder. Fix: point it at an "
                                       "HF model folder (config, tokenizer, weights) on this machine")
    if tokenizer_fingerprint(policy_path) != tokenizer_fingerprint(teacher_path):
        raise TeacherTokenizerMismatch(
            f"{field}={teacher_path!r} has another tokenizer than the policy ({policy_path!r}): its log-probs "
            "would be of other tokens. Fix: use a teacher of the same model family with the same tokenizer files")


class Teacher:
    """Log-probs of sampled tokens under the teacher, from one or more teacher engines (each request's sequences
    spread over them by an EngineRouter, as the policy's rollouts are)."""

    def __init__(self, clients: list[EngineClient], policy: str = "least_loaded"):
        if not clients:
            raise ValueError("Teacher needs at least one engine client")
        self.clients = clients
        self.router = EngineRouter(clients, policy)

    def check_tokenizer(self, policy_path: str) -> None:
        """teacher.urls: each running server says where its tokenizer is (SGLang's /model_info); one on this machine
        is compared with the policy's, one elsewhere cannot be, and is trusted (logged)."""
        for i, client in enumerate(self.clients):
            info = client.call("/model_info", method="GET") or {}
            path = info.get("tokenizer_path") or info.get("model_path")
            if path and os.path.isdir(path):
                check_same_tokenizer(policy_path, path, field=f"teacher.urls[{i}] ({client.url}) serves tokenizer")
            else:
                logger.warning("teacher %s: its tokenizer (%r) is not on this machine; not compared with the "
                               "policy's", client.url, path)

    def response_log_probs(self, prompts: list, responses: list, top_k: int = 0) -> list[TaughtResponse]:
        """For each (prompt ids, response ids): log p_teacher(response[j] | prompt + response[:j]) for every response
        token, float32, and with top_k the teacher's k most likely tokens at each of those positions with their
        log-probs; one batched prefill request per teacher engine (EngineClient.prefill: logprob_start_len=0, the
        teacher's own distribution at temperature 1, whatever the rollout's sampling temperature)."""
        sequences = [list(map(int, p)) + list(map(int, r)) for p, r in zip(prompts, responses)]
        out = []
        for seq, response, scored in zip(sequences, responses, self.router.prefill(sequences, top_k)):
            log_probs, n = scored.input_log_probs or [], len(response)
            tops = [] if not top_k else [scored.input_top_ids, scored.input_top_log_probs]
            if len(log_probs) != len(seq) - 1 or any(t is None or len(t) != len(seq) - 1 for t in tops):
                urls = ", ".join(c.url for c in self.clients)
                each = ", each with its top-k" if top_k else ""
                raise UserError(f"a teacher engine ({urls}) returned {len(log_probs)} log-probs for a "
                                f"{len(seq)}-token sequence (expected {len(seq) - 1}{each}). Fix: serve the teacher "
                                "with SGLang >= 0.5 (input_token_logprobs and input_top_logprobs with "
                                "logprob_start_len=0)")
            top_ids, top_log_probs = (t[len(t) - n:] for t in tops) if top_k else (None, None)
            out.append(TaughtResponse(np.asarray(log_probs[len(log_probs) - n:] if n else [], dtype=np.float32),
                                      top_ids, top_log_probs))
        return out


@dataclass
class TaughtResponse:
    """The teacher's view of one sampled response: its log-prob of each response token ([n] float32) and, with
    algorithm.opd_top_k = k, its k most likely tokens at each response position ([n, k] int32) with their log-probs
    ([n, k] float32)."""
    log_probs: np.ndarray
    top_ids: np.ndarray | None = None
    top_log_probs: np.ndarray | None = None
