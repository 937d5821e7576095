"""The plain load's inner loop (galahad._readhash.read_hashed) against a bare os.preadv of the same page-cached
4 MiB frames. Not a product test.

    python bench/ab/plain-floor-bench.py                    # 256 KiB steps, 1-3 threads (twenty-ninth session;
                                                            # bench/results/s29/plain-floor.txt)
    python bench/ab/plain-floor-bench.py --steps 128,256,384,512,1024 --threads 1,2
                                                            # the step's size (thirtieth session;
                                                            # bench/results/s30/readhash-step.txt)
"""
import argparse, os, time, mmap
from concurrent.futures import ThreadPoolExecutor
import galahad._readhash as R
ap=argparse.ArgumentParser()
ap.add_argument("--steps",default="256",help="read_hashed step sizes, KiB, comma-separated")
ap.add_argument("--threads",default="1,2,3")
args=ap.parse_args()
F=4<<20; N=72
path="/tmp/plain-bench.bin"
with open(path,"wb") as f:
    f.write(b"\0"*4096)
    for i in range(N): f.write(os.urandom(F))
fd=os.open(path,os.O_RDONLY)
dst=memoryview(mmap.mmap(-1,F*N))
def raw(i): os.preadv(fd,[dst[i*F:(i+1)*F]],4096+i*F)
def hashed(step):
  def run(i): R.read_hashed(fd,4096+i*F,dst[i*F:(i+1)*F],7,step<<10)
  return run
cases=[(raw,"raw preadv")]+[(hashed(int(k)),f"read_hashed {k} KiB") for k in args.steps.split(",")]
threads=[int(t) for t in args.threads.split(",")]
res={}
for rep in range(3):
  for fn,name in cases:
    for T in threads:
        with ThreadPoolExecutor(T) as ex:
            best=0
            for r in range(7):
                t=time.perf_counter(); list(ex.map(fn,range(N))); el=time.perf_counter()-t
                best=max(best,F*N/el/1e9)
        res.setdefault((name,T),[]).append(best)
for (name,T),v in sorted(res.items(),key=lambda kv:(kv[0][1],kv[0][0])): print(f"{name:22s} T={T}", " ".join(f"{x:.2f}" for x in v))
