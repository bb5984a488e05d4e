"""``vitgraph serve`` and Ray: a local instance of its own, or the cluster ``RAY_ADDRESS`` names
(or a local one already running), where it touches only its own application.

* Its application is deployed under its own name (``--app-name``), refused where the cluster
  already runs one of that name, and on exit only that application is deleted
  (``serve.delete``), never the cluster's Serve instance (``serve.shutdown`` ends every
  application on it). Then the driver leaves Ray (a local instance it started ends with it).
* Serve's HTTP options (host, port, request timeout) are set once, when Serve starts on a
  cluster. Where Serve already runs there, the ones asked for cannot apply: each that differs
  is named in a warning, the start-up line says what is really served, and the application
  takes its own route prefix (``/APP-NAME``) rather than the root.
"""

from __future__ import annotations

FLAGS = {"host": "--host", "port": "--port", "request_timeout_s": "--request-timeout"}
# Where Serve keeps its controller: a detached actor of this name and namespace
# (ray.serve._private.constants; tests/test_serve.py checks them against Ray's).
CONTROLLER, NAMESPACE = "SERVE_CONTROLLER_ACTOR", "serve"


def running_http_options(ray) -> dict | None:
    """The HTTP options of the Serve instance running on the connected cluster (its controller's
    own answer), or None where none runs."""
    try:
        controller = ray.get_actor(CONTROLLER, namespace=NAMESPACE)
    except ValueError:  # no such actor: Serve is not running there
        return None
    config = ray.get(controller.get_http_config.remote(), timeout=60)
    return {name: getattr(config, name) for name in FLAGS}


def start_http(ray, serve, host: str, port: int, request_timeout_s: float) -> tuple[dict, list[str], bool]:
    """Start Serve with these HTTP options, or join the one already running: ``(the options in
    force, a warning per option asked for that they differ from, whether Serve was running)``."""
    asked = {"host": host, "port": port, "request_timeout_s": request_timeout_s}
    running = running_http_options(ray)
    if running is None:
        serve.start(http_options=asked)
        return asked, [], False
    warnings = [f"{FLAGS[name]} {asked[name]} does not apply: the cluster's Serve instance runs with "
                f"{name} = {running[name]} (set when Serve started there)"
                for name in FLAGS if running[name] != asked[name]]
    return running, warnings, True


def check_app_name(serve, name: str) -> None:
    """Refuse a name that is empty or taken by an application already on the cluster."""
    if not name or "/" in name:
        raise ValueError(f"--app-name must be a non-empty name without '/', got {name!r}")
    if name in serve.status().applications:
        raise ValueError(f"--app-name {name}: the cluster already runs an application of that name; "
                         f"pass another --app-name (vitgraph serve deletes only its own application on exit)")


def url(options: dict, route_prefix: str) -> str:
    return f"http://{options['host']}:{options['port']}{route_prefix.rstrip('/')}/encode"
