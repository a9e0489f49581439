"""The demo sender of the compose stack: every payment callback five times at once."""

from __future__ import annotations

from proj import payment_callback

from celery_singleton_lock import is_skipped


def main() -> None:
    results = [(order, payment_callback.delay(order, 100 * order))
               for order in (1, 2, 3) for _ in range(5)]
    for order, res in results:
        value = res.get(timeout=60)
        print(order, "skipped" if is_skipped(value) else f"ran with token {value['token']}")


if __name__ == "__main__":
    main()
