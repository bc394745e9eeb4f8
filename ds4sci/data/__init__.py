"""ds4sci.data"""
