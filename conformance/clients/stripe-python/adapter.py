"""stripe-python's built-in retries under `idemcheck client`: one ``stripe.Customer.create`` against
the kit (``api_base``), with ``max_network_retries = 3``. The SDK makes the ``Idempotency-Key``
itself (once per call, before its retry loop); the adapter passes none, so what is checked is the
SDK's own behaviour. Its retries are counted, not timed: three retries wait about 0.5 + 1 + 2 s,
within the kit's default budget (``IDEMCHECK_MAX_ELAPSED``, which the SDK has no setting for).

    idemcheck client --path /v1/customers -- target/tools/third-party-clients-venv/bin/python \\
        conformance/clients/stripe-python/adapter.py
"""

import os
import sys

import stripe


def main() -> int:
    stripe.api_key = "sk_test_idemcheck"
    stripe.api_base = os.environ["IDEMCHECK_URL"]
    stripe.max_network_retries = 3
    try:
        customer = stripe.Customer.create(email="idemcheck@example.com")
    except stripe.StripeError as error:
        print(f"{type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print(customer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
