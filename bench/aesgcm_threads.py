"""Whether the installed cryptography runs AES-GCM outside the interpreter lock: 4 MiB frames
opened with `AESGCM.decrypt_into` and with a streaming GCM decryptor (`update_into`), on one
thread and on two, and pycryptodome's the same way. A measurement behind docs/security.md and
`aesgcm.OPENSSL_OUTSIDE_LOCK`, not a test.

    python bench/aesgcm_threads.py
    pip install --no-deps --target /tmp/c48 cryptography==48.0.0    # another version beside it
    PYTHONPATH=/tmp/c48 python bench/aesgcm_threads.py
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import cryptography
from Crypto.Cipher import AES
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

FRAME, ROUNDS = 4 << 20, 15


def main() -> None:
    key, data, nonce, aad = os.urandom(32), os.urandom(FRAME), os.urandom(12), b"h" * 40
    aead = AESGCM(key)
    sealed = aead.encrypt(nonce, data, aad)
    ct, tag = memoryview(sealed)[:-16], bytes(sealed[-16:])
    pct, ptag = AES.new(key, AES.MODE_GCM, nonce=nonce).encrypt_and_digest(data)

    def into(out: memoryview) -> None:
        aead.decrypt_into(nonce, sealed, aad, out[:FRAME])

    def stream(out: memoryview) -> None:
        d = Cipher(algorithms.AES(key), modes.GCM(nonce, tag)).decryptor()
        d.authenticate_additional_data(aad)
        d.update_into(ct, out)
        d.finalize()

    def pycryptodome(out: memoryview) -> None:
        AES.new(key, AES.MODE_GCM, nonce=nonce).decrypt_and_verify(pct, ptag, output=out[:FRAME])

    cases: list[tuple[str, Callable[[memoryview], None]]] = [("update_into", stream), ("pycryptodome", pycryptodome)]
    if hasattr(aead, "decrypt_into"):
        cases.insert(0, ("decrypt_into", into))
    for name, fn in cases:
        rates = []
        for threads in (1, 2):
            def work() -> None:
                out = memoryview(bytearray(FRAME + 16))
                for _ in range(ROUNDS):
                    fn(out)

            pool = [threading.Thread(target=work) for _ in range(threads)]
            t0 = time.perf_counter()
            for th in pool:
                th.start()
            for th in pool:
                th.join()
            rates.append(threads * ROUNDS * FRAME / (time.perf_counter() - t0) / 1e9)
        print(f"cryptography {cryptography.__version__}: {name}: 1 thread {rates[0]:.2f} GB/s, 2 threads "
              f"{rates[1]:.2f} GB/s (x{rates[1] / rates[0]:.2f})", flush=True)


if __name__ == "__main__":
    main()
