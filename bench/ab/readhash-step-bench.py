"""The plain load's inner loop (galahad._readhash.read_hashed) at read steps of 128 KiB to 1 MiB against a bare
os.preadv of the same page-cached 4 MiB frames, 1 and 2 threads (thirtieth session; bench/results/s30/readhash-step.txt).
Not a product test."""
import os, time, mmap
from concurrent.futures import ThreadPoolExecutor
import galahad._readhash as R
F=4<<20; N=72
path="/tmp/plain-bench.bin"
if not os.path.exists(path):
  with open(path,"wb") as f:
    f.write(b"\0"*4096)
    for i in range(N): f.write(os.urandom(F))
fd=os.open(path,os.O_RDONLY)
dst=memoryview(mmap.mmap(-1,F*N))
def raw(i): os.preadv(fd,[dst[i*F:(i+1)*F]],4096+i*F)
def mk(step):
  def hashed(i): R.read_hashed(fd,4096+i*F,dst[i*F:(i+1)*F],7,step)
  return hashed
cases=[(raw,"raw")]+[(mk(k<<10),f"step{k}") for k in (128,256,384,512,1024)]
res={}
for rep in range(3):
  for fn,name in cases:
    for T in (1,2):
        with ThreadPoolExecutor(T) as ex:
            best=0
            for r in range(7):
                t=time.perf_counter(); list(ex.map(fn,range(N))); el=time.perf_counter()-t
                best=max(best,F*N/el/1e9)
        res.setdefault((name,T),[]).append(best)
for k,v in sorted(res.items(),key=lambda kv:(kv[0][1],kv[0][0])): print(f"{k[0]:10s} T={k[1]}", " ".join(f"{x:.2f}" for x in v))
