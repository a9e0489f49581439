"""The web endpoint a payment provider calls: ``POST /webhooks/payment``.

The provider repeats its call until it gets a 2xx in time (and sometimes after):
the endpoint only hands the event to Celery and answers 202 at once.

    python web.py --port 8000        # or: flask --app web run

``--port 0`` takes any free port; the first line on stdout names the address.
"""

from __future__ import annotations

import argparse
from typing import Any

import payments
from flask import Flask, jsonify, request
from werkzeug.serving import make_server

web = Flask(__name__)


def _event() -> tuple[int, int]:
    body: dict[str, Any] = request.get_json(force=True)
    return int(body["order_id"]), int(body["amount_cents"])


@web.post("/webhooks/payment")
def payment_webhook() -> Any:
    order_id, cents = _event()
    result = payments.charge.delay(order_id, cents)
    return jsonify({"task_id": result.id}), 202


@web.post("/webhooks/payment-unguarded")
def payment_webhook_unguarded() -> Any:
    """The same endpoint over the task without the lock (for the comparison)."""
    order_id, cents = _event()
    result = payments.charge_unguarded.delay(order_id, cents)
    return jsonify({"task_id": result.id}), 202


@web.get("/health")
def health() -> Any:
    return jsonify({"ok": True})


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    server = make_server("127.0.0.1", args.port, web, threaded=True)
    print(f"Listening on http://127.0.0.1:{server.server_port}", flush=True)
    server.serve_forever()
