"""bench/ab/read-opened-gcrypt.diff against the shipped sealed path: 24 sealed 4 MiB frames of a
page-cached file opened into one buffer, 1, 2 and 4 threads, best of 7, three times over
(twenty-ninth session; not a product test). Three ways: the shipped one (the frame read into a
per-thread buffer, then `AESGCM.decrypt_into` into its place), the same in 256 KiB pieces through
OpenSSL's streaming decryptor, each decrypted in place as it lands (Python loop), and the diff's
C loop through libgcrypt. Needs the diff applied and built (`python setup.py build_ext --inplace`)."""
import os, time, mmap, threading, sys
from concurrent.futures import ThreadPoolExecutor
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
import galahad._readhash as R
F=4<<20; N=24; STEP=256<<10
key=os.urandom(32); a=AESGCM(key); aad=os.urandom(300)
path="/tmp/ro-bench.bin"
plain=[os.urandom(F) for _ in range(N)]
tags=[]
with open(path,"wb") as f:
    f.write(b"\0"*4096)
    for i,p in enumerate(plain):
        ct=a.encrypt(i.to_bytes(12,"little"),p,aad); f.write(ct); tags.append(ct[-16:])
fd=os.open(path,os.O_RDONLY)
dst=memoryview(mmap.mmap(-1,F*N))
loc=threading.local()
def shipped(i):
    buf=getattr(loc,"b",None)
    if buf is None: buf=loc.b=memoryview(mmap.mmap(-1,F+16))
    os.preadv(fd,[buf],4096+i*(F+16))
    a.decrypt_into(i.to_bytes(12,"little"),buf,aad,dst[i*F:(i+1)*F])
def pyfused(i):
    d=dst[i*F:(i+1)*F]; at=4096+i*(F+16)
    dec=Cipher(algorithms.AES(key),modes.GCM(i.to_bytes(12,"little"),tags[i])).decryptor()
    dec.authenticate_additional_data(aad)
    for o in range(0,F,STEP):
        p=d[o:o+STEP]; os.preadv(fd,[p],at+o)
        if o+STEP<F: dec.update_into(p, d[o:o+STEP+15])
        else:
            h=len(p)-15; dec.update_into(p[:h], p); p[h:]=dec.update(p[h:])
    dec.finalize()
def gfused(i):
    got,ok=R.read_opened(fd,4096+i*(F+16),dst[i*F:(i+1)*F],key,i.to_bytes(12,"little"),aad,b"",STEP)
    assert ok and got==F+16
res={}
for rep in range(3):
  for fn,name in ((shipped,"shipped"),(pyfused,"openssl fused (py)"),(gfused,"gcrypt fused (C)")):
    for T in (1,2,4):
        with ThreadPoolExecutor(T) as ex:
            best=0
            for r in range(7):
                dst[5*F:6*F]=bytes(F)
                t=time.perf_counter(); list(ex.map(fn,range(N))); el=time.perf_counter()-t
                best=max(best,F*N/el/1e9)
        assert bytes(dst[5*F:6*F])==plain[5], name
        res.setdefault((name,T),[]).append(best)
for k,v in sorted(res.items()): print(f"{k[0]:22s} T={k[1]}", " ".join(f"{x:.2f}" for x in v))
