"""``shardtune download REPO DIR``: the files of an HF model a run reads, and no others.

Rule: one ``huggingface_hub.snapshot_download`` into ``DIR`` restricted to :data:`MODEL_FILES`
(config, safetensors weights and their index, tokenizer and chat-template files), so ``.bin``
and ``original/`` copies of the weights are never fetched. The hub client resumes an
interrupted download in place and reads the token from the environment (``HF_TOKEN``) or
``hf auth login``; a repository it cannot reach is reported as one message with the fix.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["MODEL_FILES", "download_model"]

MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates/*",
)


class DownloadError(RuntimeError):
    """A repository the hub refused or that holds no model; the message names the fix."""


def download_model(repo: str, directory: str | Path, *, revision: str | None = None) -> Path:
    """``repo``'s model files in ``directory`` (created; files already there complete are kept)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        path = Path(
            snapshot_download(repo, revision=revision, local_dir=str(directory), allow_patterns=list(MODEL_FILES))
        )
    except GatedRepoError:
        raise DownloadError(
            f"{repo} is gated: accept its license on https://huggingface.co/{repo}, then set HF_TOKEN to a token of "
            "that account (or run hf auth login) and download again"
        ) from None
    except RevisionNotFoundError:
        raise DownloadError(f"{repo} has no revision {revision!r}; give an existing branch, tag or commit") from None
    except RepositoryNotFoundError:
        raise DownloadError(
            f"{repo} was not found on the hub (or is private: set HF_TOKEN to a token that can read it); check "
            "the name, e.g. Qwen/Qwen3-8B"
        ) from None
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise DownloadError(
            f"{repo} downloaded to {path} but holds no config.json and *.safetensors weights; shardtune trains "
            "transformers models saved as safetensors (a PEFT adapter repository: download its base model)"
        )
    return path
