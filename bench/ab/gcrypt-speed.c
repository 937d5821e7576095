/* libgcrypt's AES-256-GCM on a 4 MiB buffer in memory, one core, best of 5 x 16 (twenty-ninth session, beside
 * `openssl speed -evp aes-256-gcm -decrypt -bytes 4194304`): gcc -O2 bench/ab/gcrypt-speed.c -o /tmp/gcs -lgcrypt && /tmp/gcs
 * Needs libgcrypt20-dev. Not a product part: the measurement behind bench/ab/read-opened-gcrypt.diff. */
#include <gcrypt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(){
  if(!gcry_check_version(NULL)) return 1;
  gcry_control(GCRYCTL_INITIALIZATION_FINISHED,0);
  size_t F=4<<20; unsigned char *buf=aligned_alloc(64,F); memset(buf,7,F);
  unsigned char key[32]={1}, iv[12]={0}, aad[300]={2}, tag[16];
  gcry_cipher_hd_t h; gcry_cipher_open(&h,GCRY_CIPHER_AES256,GCRY_CIPHER_MODE_GCM,0);
  gcry_cipher_setkey(h,key,32);
  for(int mode=0;mode<2;mode++){
  double best=0;
  for(int r=0;r<5;r++){ double t=now(); for(int i=0;i<16;i++){ gcry_cipher_reset(h); gcry_cipher_setiv(h,iv,12); gcry_cipher_authenticate(h,aad,300);
     if(mode==0) gcry_cipher_encrypt(h,buf,F,NULL,0); else gcry_cipher_decrypt(h,buf,F,NULL,0); gcry_cipher_gettag(h,tag,16);} double el=now()-t; double g=16.0*F/el/1e9; if(g>best)best=g;}
  printf("%s %.2f GB/s\n", mode?"decrypt":"encrypt", best);}
  printf("%s\n", gcry_check_version(NULL));
  return 0;}
