"""bench/ab/read-opened.diff against the shipped sealed path: 24 sealed 4 MiB frames of a page-cached
file opened into one buffer, 1 and 2 threads, best of 5 (twenty-seventh session; not a product test)."""
import ctypes, os, time, mmap, threading, sys
from concurrent.futures import ThreadPoolExecutor
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
import galahad._readhash as R
lib = ctypes.CDLL("libcrypto.so.3")
syms = ["EVP_CIPHER_CTX_new","EVP_CIPHER_CTX_free","EVP_aes_256_gcm","EVP_DecryptInit_ex","EVP_CIPHER_CTX_ctrl","EVP_DecryptUpdate","EVP_DecryptFinal_ex"]
R.bind_crypto(*[ctypes.cast(getattr(lib,s), ctypes.c_void_p).value for s in syms])
F=4<<20; N=24
key=os.urandom(32); a=AESGCM(key); aad=os.urandom(300)
path="/tmp/read-opened-bench.bin"
plain=[os.urandom(F) for _ in range(N)]
tags=[]
with open(path,"wb") as f:
    f.write(b"\0"*4096)
    for i,p in enumerate(plain):
        ct=a.encrypt(i.to_bytes(12,"little"),p,aad); f.write(ct[:-16]); tags.append(ct[-16:])
fd=os.open(path,os.O_RDONLY)
dst=memoryview(mmap.mmap(-1,F*N))
loc=threading.local()
def cur(i):
    buf=getattr(loc,"b",None)
    if buf is None: buf=loc.b=memoryview(mmap.mmap(-1,F+16))
    os.preadv(fd,[buf[:F]],4096+i*F); buf[F:]=tags[i]
    a.decrypt_into(i.to_bytes(12,"little"),buf,aad,dst[i*F:(i+1)*F])
def new(step):
    def f(i):
        got,ok=R.read_opened(fd,4096+i*F,dst[i*F:(i+1)*F],key,i.to_bytes(12,"little"),aad,tags[i],step)
        assert ok and got==F+16
    return f
for fn,name in ((cur,"python"),(new(256<<10),"C 256K"),(new(64<<10),"C 64K"),(new(1<<20),"C 1M")):
    for T in (1,2):
        with ThreadPoolExecutor(T) as ex:
            best=0
            for r in range(5):
                t=time.perf_counter(); list(ex.map(fn,range(N))); el=time.perf_counter()-t
                best=max(best,F*N/el/1e9)
        assert bytes(dst[5*F:6*F])==plain[5]
        print(f"{name:8s} T={T} {best:.2f} GB/s")
