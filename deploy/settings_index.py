"""What each CoSine service accepts: its settings class, ``COSINE_*`` names, default port and
health service name. Deployment checks compare docker-compose and the rendered chart with this,
so a misspelt variable or a wrong port fails a test instead of a rollout."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from common.platform.settings import ENV_PREFIX, env_name, load_settings

SERVICES = ("drafter", "verifier", "router", "gateway")


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    settings_cls: type
    env_names: frozenset[str]
    default_port: int
    health_service: str  # grpc.health.v1 service name besides ""
    module: str  # python -m <module>

    def port(self, env: Mapping[str, str]) -> int:
        return int(env.get(env_name("port"), self.default_port))

    def unknown(self, env: Mapping[str, Any]) -> list[str]:
        """COSINE_* names in ``env`` this service does not accept."""
        return sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in self.env_names)

    def load(self, env: Mapping[str, str]) -> Any:
        """Build the service's settings from ``env`` exactly as the service would (raises SettingsError)."""
        cosine = {k: str(v) for k, v in env.items() if k.startswith(ENV_PREFIX)}
        return load_settings(self.settings_cls, [], cosine, prog=self.module)


def _settings_class(name: str) -> type:
    module = importlib.import_module(f"services.{name}.settings")
    classes = [
        obj for obj in vars(module).values() if isinstance(obj, type) and obj.__name__ == f"{name.capitalize()}Settings"
    ]
    if len(classes) != 1:
        raise LookupError(f"services/{name}/settings.py: expected one {name.capitalize()}Settings class")
    return classes[0]


def _health_service(name: str) -> str:
    """The grpc.health.v1 name the service registers (its proto service, cosine.v1.<Name>).
    tests/test_deploy_compose.py checks it against services/<name>/server.py:SERVICE_NAME; it is
    not imported from there so that these checks need only the settings modules."""
    return f"cosine.v1.{name.capitalize()}"


def service_specs() -> dict[str, ServiceSpec]:
    specs = {}
    for name in SERVICES:
        cls = _settings_class(name)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        specs[name] = ServiceSpec(
            name=name,
            settings_cls=cls,
            env_names=frozenset(env_name(f) for f in fields),
            default_port=int(fields["port"].default),
            health_service=_health_service(name),
            module=f"services.{name}",
        )
    return specs
