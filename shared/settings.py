"""Settings, one class per service. Values come from the environment (`CORTEX_` prefix) and,
optionally, a TOML file named by `CORTEX_CONFIG` (a `[gateway]` / `[node]` table each)."""

import os
from pathlib import Path
from typing import Any, ClassVar

from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource


class _TomlTable(TomlConfigSettingsSource):
    """Reads one table of the file named by CORTEX_CONFIG."""

    def __init__(self, settings_cls: type[BaseSettings], table: str):
        path = os.environ.get("CORTEX_CONFIG")
        super().__init__(settings_cls, toml_file=Path(path) if path else None)
        self.toml_data = self.toml_data.get(table, {}) | {
            k: v for k, v in self.toml_data.items() if not isinstance(v, dict)
        }

    def __call__(self) -> dict[str, Any]:
        return self.toml_data


class CortexSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CORTEX_", extra="ignore")
    toml_table: ClassVar[str] = ""

    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "cortex:"
    models_file: Path | None = None  # models.toml; the built-in catalogue when absent
    log_level: str = "INFO"

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _TomlTable(settings_cls, cls.toml_table)

    @property
    def keys(self):
        from shared.keys import Keys

        return Keys(self.key_prefix)


class GatewaySettings(CortexSettings):
    toml_table: ClassVar[str] = "gateway"

    host: str = "127.0.0.1"
    port: int = 31313
    node_ttl_s: float = 8.0  # a node whose heartbeat is older than this is dead
    request_timeout_s: float = 600.0  # longest a request may wait for its next event
    stream_maxlen: int = 100_000  # MAXLEN ~ for each per-model job stream


class NodeSettings(CortexSettings):
    toml_table: ClassVar[str] = "node"

    node_name: str = ""  # default: hostname-pid
    models: list[str] = ["SmolLM2-135M-Instruct"]  # catalogue ids this node loads at start
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    heartbeat_s: float = 2.0
    heartbeat_ttl_s: float = 8.0
    claim_idle_ms: int = 30_000  # pending entries idle this long are claimed from dead consumers
    torch_threads: int = 0  # 0: torch's default
    hf_cache: str | None = None  # Hugging Face cache dir; else HF_HUB_CACHE, HF_HOME/hub, the default
    # Dequantised copies of GGUF files (loads in ~1 s instead of ~15 s); empty disables it.
    convert_cache: Path | None = Path.home() / ".cache" / "cortex" / "converted"
    min_free_mb: int = 256  # below this much free device memory, new jobs get 503 insufficient_memory
    shutdown_grace_s: float = 30.0  # on SIGTERM, running jobs get this long to finish
